"""Pictures of one draft tree: its nodes coloured by what the verifier did, and its mask.

Everything here is a pure function from specviz objects to a figure, so notebooks, the
explorer widget (:mod:`specviz.render.explorer`) and saved files all draw with the same
code (whole generations: :mod:`specviz.render.steps`; files:
:mod:`specviz.render.export`):

* :func:`tree_figure` / :func:`step_tree_figure` - the draft tree drawn with the tidy
  layout of :mod:`specviz.render.layout`, nodes coloured by status (:data:`STATUS_STYLE`),
  accepted path emphasised, filling the width of its notebook cell or page;
* :func:`mask_figure` - the tree-attention mask as a heatmap labelled by node.

What they draw comes from :mod:`specviz.render.nodes` (:func:`tree_nodes`, one
:class:`NodeInfo` per node, the single place where statuses, labels and per-node
numbers are worked out; :func:`collapse_untried`, the "+N" nodes of a large tree;
:func:`to_networkx`; the node statuses :data:`STATUSES`), and their text goes through
:mod:`specviz.render.text` (:func:`escape_token`, :func:`token_text`,
:func:`figure_title`). This module re-exports those names, so they import from here as
before.

Every text that reaches plotly (labels, hovers, titles, tick labels) goes through
:func:`plot_text`, so token text is shown as it is: quotes stay quotes and ``<b>`` is
not read as markup.

Dimension legend: N = draft-tree nodes including the root, P = committed prefix length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from specviz.render.layout import TreeLayout, tidy_layout
from specviz.render.nodes import (
    STATUSES,
    UNTRIED,
    CollapsedNodes,
    NodeInfo,
    collapse_untried,
    on_accepted_path,
    to_networkx,
    tree_nodes,
)
from specviz.render.text import MONO_FONT, escape_token, figure_title, plot_text, token_text
from specviz.tree.core import DraftTree, tree_attention_mask
from specviz.tree.shapes import TreeShape

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from specviz.decode.records import StepTrace
    from specviz.verify.rules import Acceptance

__all__ = [
    "STATUSES",
    "STATUS_STYLE",
    "StatusStyle",
    "NodeInfo",
    "CollapsedNodes",
    "COLLAPSE_ABOVE",
    "COLLAPSED_STYLE",
    "escape_token",
    "token_text",
    "tree_nodes",
    "collapse_untried",
    "UNTRIED",
    "to_networkx",
    "tree_figure",
    "step_tree_figure",
    "mask_figure",
    "figure_title",
    "plot_text",
]


@dataclass(frozen=True)
class StatusStyle:
    """How nodes of one status are drawn: colour, marker symbol and marker size (px)."""

    color: str
    symbol: str
    size: int


# Okabe-Ito colours (distinguishable with the common colour-vision deficiencies), and a
# different marker symbol per status so the legend reads even in greyscale print.
STATUS_STYLE: dict[str, StatusStyle] = {
    "root": StatusStyle("#000000", "square", 16),
    "accepted": StatusStyle("#009E73", "circle", 20),
    "bonus": StatusStyle("#E69F00", "star", 22),
    "rejected": StatusStyle("#D55E00", "x", 14),
    "not chosen": StatusStyle("#56B4E9", "diamond-open", 14),
    "never reached": StatusStyle("#999999", "circle-open", 13),
    "drafted": StatusStyle("#0072B2", "circle", 15),
}
#: how a "+N" node (untried nodes folded into one, see :func:`collapse_untried`) is drawn
COLLAPSED_STYLE = StatusStyle("#777777", "square-open", 16)
#: :func:`tree_figure` folds untried subtrees of trees with more nodes than this (root included)
COLLAPSE_ABOVE = 40
_PATH_COLOR = STATUS_STYLE["accepted"].color
_EDGE_COLOR = "#BBBBBB"


# -- plotly helpers ---------------------------------------------------------------------------

def _fmt(value: float | None) -> str:
    """A probability for a hover: three decimals, or a dash when unknown."""
    return "–" if value is None else f"{value:.3f}"


def _hover(v: NodeInfo) -> str:
    """The hover text of one node: its whole token, index, depth, status, rank, q, p and
    acceptance probability."""
    token = "" if v.token is None else f" (id {v.token})"
    lines = [
        f"<b>{plot_text(escape_token(v.text, max_chars=None))}</b>{token}",
        f"node {v.index} · depth {v.depth} · {v.status}",
        f"rank {'–' if v.rank is None else v.rank}",
        f"q (draft prob) {_fmt(v.q)}",
        f"p (target prob) {_fmt(v.p)}",
        f"acceptance prob {_fmt(v.accept_prob)}",
    ]
    return "<br>".join(lines)


def _group_hover(g: CollapsedNodes, parent: NodeInfo) -> str:
    """The hover text of one "+N" node: what it holds and where it hangs."""
    shown = ", ".join(plot_text(_label(label, 12)) for label in g.labels[:8]) + (" …" if len(g.labels) > 8 else "")
    below = f"below node {g.parent} ({plot_text(parent.label)}, {parent.status})"
    return "<br>".join([
        f"<b>+{g.size} untried nodes</b> {below}",
        f"{g.not_chosen} not chosen · {g.size - g.not_chosen} never reached",
        f"children: {shown}",
        "draw with collapse=False to see them",
    ])


def _edge_xy(pairs: Sequence[tuple[int, int]], x: Sequence[float], y: Sequence[float]):
    """The x and y coordinates of one line trace through the edges ``pairs`` (drawn-node
    indices), each edge ended by a gap (None); y points up, so rows are negated."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    for a, b in pairs:
        xs += [x[a], x[b], None]
        ys += [-y[a], -y[b], None]
    return xs, ys


# Sizing of tree figures: markers and labels are planned for a plot this wide (px); the
# figure itself fills its container, so on a wider page there is more room.
_MARGIN_X = 30
_FULL_SIZE_PX = 56  # px per node column from which markers and labels are drawn full size
_CHAR_EM = 0.62     # width of a monospace character, in font sizes


def _sizing(columns: float, width_hint: int) -> dict:
    """Marker scale, font size, label position and label length for a tree whose
    widest extent is ``columns`` node spacings, drawn about ``width_hint`` px wide."""
    pad = 0.6
    plot_px = width_hint - 2 * _MARGIN_X
    right = columns + 2 * pad + 1.0  # x units with labels right of their nodes
    px_per_unit = plot_px / right
    if px_per_unit >= _FULL_SIZE_PX:  # roomy: labels right of the nodes, full size
        font = 12
        chars = int((px_per_unit - 14) / (_CHAR_EM * font))
        return dict(scale=1.0, font=font, position="middle right", chars=max(2, min(chars, 16)),
                    x_range=(-pad, columns + pad + 1.0))
    px_per_unit = plot_px / (columns + 2 * pad)  # crowded: labels under the nodes
    scale = max(0.4, min(1.0, px_per_unit / _FULL_SIZE_PX))
    font = max(8, min(12, int(px_per_unit / 3.2)))
    chars = int((px_per_unit - 2) / (_CHAR_EM * font))
    return dict(scale=scale, font=font, position="bottom center", chars=chars if chars >= 2 else 0,
                x_range=(-pad, columns + pad))


def _label(label: str, chars: int) -> str:
    """``label`` cut to ``chars`` characters with ``…`` (empty for ``chars == 0``)."""
    if chars == 0:
        return ""
    return label if len(label) <= chars else label[: max(1, chars - 1)] + "…"


def tree_figure(tree: DraftTree | TreeShape, acceptance: "Acceptance | None" = None, *,
                tokenizer: Any = None,
                target_probs: "torch.Tensor | Sequence[float] | None" = None,
                title: str | None = None, collapse: bool | None = None,
                width_hint: int = 900, row_px: int = 80) -> "go.Figure":
    """Draw a draft tree: tidy layout, nodes coloured by status, accepted path emphasised.

    One marker trace per status present (so the legend lists exactly those); labels are
    the decoded tokens with visible whitespace, cut to fit (the hover has them whole),
    and hovering a node shows its rank, q, p, acceptance probability and depth.

    The figure fills the width of its container (a notebook cell, an HTML page) and
    grows ``row_px`` per depth. Large verified trees stay readable: with ``collapse``
    the untried subtrees are folded into "+N" nodes (:func:`collapse_untried`; hover one
    for what it holds), while the accepted path, the bonus token and every tried node
    stay. Where a row is still crowded, markers and fonts shrink and labels move under
    their nodes (or, with no room at all, are left to the hover). The figure opens in pan
    mode with scroll zoom for a closer look.

    Args:
        tree, acceptance, tokenizer, target_probs: as in :func:`tree_nodes`.
        title: figure title (default: node counts and the accepted length).
        collapse: fold untried subtrees into "+N" nodes; None (default) folds them when
            the tree has more than :data:`COLLAPSE_ABOVE` nodes and an acceptance is
            given, False draws every node.
        width_hint: the width (px) marker and label sizes are planned for; the figure
            itself always takes its container's width.
        row_px: pixels between rows.

    Returns:
        A ``plotly.graph_objects.Figure``.

    Raises:
        ValueError: ``collapse=True`` without an acceptance (nothing was tried, so
            nothing can be told apart), or ``width_hint`` / ``row_px`` out of range.
    """
    import plotly.graph_objects as go

    _check_tree_figure_args(acceptance, collapse, width_hint, row_px)
    nodes = tree_nodes(tree, acceptance, tokenizer=tokenizer, target_probs=target_probs,
                       max_label_chars=None)
    if collapse is None:
        collapse = acceptance is not None and len(nodes) - 1 > COLLAPSE_ABOVE
    kept, groups = collapse_untried(nodes) if collapse else (nodes, ())

    # layout of what is drawn: kept nodes (in node order), then one "+N" node per group
    where = {v.index: k for k, v in enumerate(kept)}
    parents = [-1] + [where[v.parent] for v in kept[1:]] + [where[g.parent] for g in groups]
    lay = tidy_layout(parents)
    size = _sizing(lay.width, width_hint)
    on_path = on_accepted_path(nodes) if acceptance is not None else set()

    fig = go.Figure()
    for trace in _edge_traces(kept, groups, where, on_path, lay) + _node_traces(kept, where, lay, size):
        fig.add_trace(trace)
    if groups:
        fig.add_trace(_group_trace(groups, nodes, len(kept), lay, size))
    _tree_figure_layout(fig, _tree_title(title, nodes, acceptance, groups, size), lay, size, row_px)
    return fig


def _check_tree_figure_args(acceptance: "Acceptance | None", collapse: bool | None,
                            width_hint: int, row_px: int) -> None:
    """Refuse :func:`tree_figure` sizes out of range, and ``collapse=True`` without an
    acceptance."""
    if isinstance(width_hint, bool) or not isinstance(width_hint, int) or width_hint < 200:
        raise ValueError(f"width_hint must be an int >= 200 (px), got {width_hint!r}")
    if isinstance(row_px, bool) or not isinstance(row_px, int) or row_px < 20:
        raise ValueError(f"row_px must be an int >= 20 (px), got {row_px!r}")
    if collapse and acceptance is None:
        raise ValueError("collapse=True needs an acceptance: without one no node was tried, "
                         "so there are no untried subtrees to fold")


def _edge_traces(kept: Sequence[NodeInfo], groups: Sequence[CollapsedNodes], where: dict[int, int],
                 on_path: set[int], lay: TreeLayout) -> list:
    """The edge traces of a tree figure, each only when it has edges: draft edges, dotted
    edges to the "+N" nodes, the accepted path (the only one in the legend) and the
    bonus edge.

    Args:
        kept: the nodes drawn, in node order; ``where`` maps a node index to its
            position in ``kept`` (the "+N" nodes follow at ``len(kept) + k``).
        groups: the "+N" nodes.
        on_path: node indices on the accepted path.
        lay: the tidy layout of the drawn nodes.
    """
    import plotly.graph_objects as go

    other = [(where[v.parent], where[v.index]) for v in kept[1:] if v.index not in on_path]
    path = [(where[v.parent], where[v.index]) for v in kept[1:]
            if v.index in on_path and v.status != "bonus"]
    bonus = [(where[v.parent], where[v.index]) for v in kept[1:] if v.status == "bonus"]
    folded = [(where[g.parent], len(kept) + k) for k, g in enumerate(groups)]
    traces = []
    for pairs, name, line in (
        (other, "draft edges", dict(color=_EDGE_COLOR, width=1.2)),
        (folded, "collapsed edges", dict(color=_EDGE_COLOR, width=1.2, dash="dot")),
        (path, "accepted path", dict(color=_PATH_COLOR, width=5)),
        (bonus, "bonus edge", dict(color=STATUS_STYLE["bonus"].color, width=3, dash="dot")),
    ):
        if pairs:
            ex, ey = _edge_xy(pairs, lay.x, lay.y)
            traces.append(go.Scatter(x=ex, y=ey, mode="lines", line=line, name=name,
                                     hoverinfo="skip", showlegend=name == "accepted path"))
    return traces


def _text_font(size: dict) -> dict:
    """The label font of a tree figure's markers, at :func:`_sizing`'s size."""
    return dict(family=MONO_FONT, size=size["font"], color="#222222")


def _node_traces(kept: Sequence[NodeInfo], where: dict[int, int], lay: TreeLayout, size: dict) -> list:
    """One marker trace per status present among the drawn nodes ``kept`` (in
    :data:`STATUSES` order), labelled and sized by :func:`_sizing`'s ``size``; each
    marker's ``customdata`` is its node index. ``where`` and ``lay`` as in
    :func:`_edge_traces`."""
    import plotly.graph_objects as go

    x, y = lay.x, lay.y
    traces = []
    for status in STATUSES:
        members = [v for v in kept if v.status == status]
        if not members:
            continue
        style = STATUS_STYLE[status]
        is_open = style.symbol.endswith("-open")
        traces.append(go.Scatter(
            x=[x[where[v.index]] for v in members], y=[-y[where[v.index]] for v in members],
            mode="markers+text", name=status,
            text=[plot_text(_label(v.label, size["chars"])) for v in members],
            textposition=size["position"], textfont=_text_font(size),
            marker=dict(color=style.color, symbol=style.symbol,
                        size=max(5, round(style.size * size["scale"])),
                        line=dict(color=style.color if is_open else "#FFFFFF", width=2 if is_open else 1.5)),
            hovertext=[_hover(v) for v in members], hoverinfo="text",
            customdata=[v.index for v in members],
        ))
    return traces


def _group_trace(groups: Sequence[CollapsedNodes], nodes: Sequence[NodeInfo], first: int,
                 lay: TreeLayout, size: dict) -> "go.Scatter":
    """The marker trace of the "+N" nodes, drawn at layout positions ``first``,
    ``first + 1``, ...; each marker's ``customdata`` is the node it hangs from, and its
    hover (:func:`_group_hover`) reads that node in ``nodes``."""
    import plotly.graph_objects as go

    return go.Scatter(
        x=[lay.x[first + k] for k in range(len(groups))],
        y=[-lay.y[first + k] for k in range(len(groups))],
        mode="markers+text", name="+N untried nodes (collapsed)",
        text=[f"+{g.size}" for g in groups], textposition=size["position"], textfont=_text_font(size),
        marker=dict(color=COLLAPSED_STYLE.color, symbol=COLLAPSED_STYLE.symbol,
                    size=max(5, round(COLLAPSED_STYLE.size * size["scale"])),
                    line=dict(color=COLLAPSED_STYLE.color, width=2)),
        hovertext=[_group_hover(g, nodes[g.parent]) for g in groups], hoverinfo="text",
        customdata=[g.parent for g in groups],
    )


def _tree_title(title: str | None, nodes: Sequence[NodeInfo], acceptance: "Acceptance | None",
                groups: Sequence[CollapsedNodes], size: dict) -> str:
    """The title of a tree figure: ``title``, or by default the node counts and the
    accepted length, with a subtitle line for the "+N" nodes and one when labels were
    left to the hover."""
    if title is None:
        title = f"draft tree: {len([v for v in nodes if v.status not in ('root', 'bonus')])} draft nodes"
        if acceptance is not None:
            title += f"\n{acceptance.n_accepted} accepted + 1 bonus (tau {acceptance.tau})"
    if groups:
        hidden = sum(g.size for g in groups)
        title += (f"\n{hidden} untried nodes shown as {len(groups)} “+N” node"
                  f"{'s' if len(groups) != 1 else ''} (hover one, or draw with collapse=False)")
    if size["chars"] == 0:
        title += "\ntoo many nodes per row for labels: hover a node for its token"
    return title


def _tree_figure_layout(fig: "go.Figure", title: str, lay: TreeLayout, size: dict, row_px: int) -> None:
    """Title, height (``row_px`` per row plus room for the title's lines), margins, legend
    and axes of a tree figure."""
    n_sub = title.count("\n")
    height = max(300, row_px * (lay.depth + 1) + 170 + 20 * n_sub)
    # title on top, legend below the tree: neither can cover the other however narrow the figure
    fig.update_layout(
        title=figure_title(title), autosize=True,
        height=height, margin=dict(l=_MARGIN_X, r=_MARGIN_X, t=70 + 20 * n_sub, b=110),
        plot_bgcolor="#FFFFFF", paper_bgcolor="#FFFFFF", dragmode="pan", hovermode="closest",
        legend=dict(orientation="h", yanchor="top", y=-0.02, xanchor="left", x=0.0),
        xaxis=dict(visible=False, range=list(size["x_range"])),
        yaxis=dict(visible=False, range=[-lay.depth - 0.6, 0.8]),
    )


def step_tree_figure(step: "StepTrace", *, tokenizer: Any = None, title: str | None = None,
                     collapse: bool | None = None) -> "go.Figure":
    """:func:`tree_figure` of one engine step (tree, acceptance and target probabilities)."""
    if title is None:
        acc = step.acceptance
        expected = step.expected_accepted
        expected = "" if math.isnan(expected) else f" (expected {expected:.3f})"
        title = (f"step {step.step} · {step.drafter}\n{step.tree.budget} draft nodes, depth "
                 f"{step.tree.depth} · accepted {acc.n_accepted}{expected} · tau {acc.tau}")
    return tree_figure(step.tree, step.acceptance, tokenizer=tokenizer,
                       target_probs=step.target_token_probs, title=title, collapse=collapse)


def mask_figure(tree: DraftTree, *, tokenizer: Any = None, prefix_len: int = 0,
                title: str | None = None, cell_px: int = 22) -> "go.Figure":
    """Heatmap of the tree-attention mask: row = query node, column = key it may attend to.

    Columns ``ctx-1 .. ctx-P`` are the committed prefix (every node sees all of it),
    then one column per tree node. Both axes are labelled ``index:token``.

    Args:
        tree: the draft tree.
        tokenizer: decodes the node labels.
        prefix_len: how many committed prefix columns to show (>= 0).
        title: figure title.
        cell_px: pixel size of one cell; sets the figure's height. Cells stay square: in a
            container narrower than the mask needs they shrink, in a wider one the mask
            keeps its size.
    """
    import plotly.graph_objects as go

    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    mask = tree_attention_mask(tree, prefix_len)  # (N, P + N) bool
    nodes = tree_nodes(tree, tokenizer=tokenizer)
    rows = [f"{v.index}:{plot_text(v.label)}" for v in nodes]
    cols = [f"ctx-{prefix_len - j}" for j in range(prefix_len)] + rows
    hover = [[f"{rows[i]} {'may attend to' if mask[i, j] else 'is masked from'} {cols[j]}"
              for j in range(len(cols))] for i in range(len(rows))]
    fig = go.Figure(go.Heatmap(
        z=mask.to(torch.int8).tolist(), x=cols, y=rows, zmin=0, zmax=1,
        colorscale=[[0.0, "#F4F4F4"], [0.5, "#F4F4F4"], [0.5, "#0072B2"], [1.0, "#0072B2"]],
        showscale=False, xgap=1, ygap=1, hovertext=hover, hoverinfo="text",
    ))
    n_rows = len(rows)
    fig.update_layout(
        title=figure_title(title or f"tree attention mask: {n_rows} nodes, prefix {prefix_len}\n"
                              "filled = may attend"),
        autosize=True, height=max(300, cell_px * n_rows + 200),
        margin=dict(l=120, r=20, t=90, b=120), plot_bgcolor="#FFFFFF",
        xaxis=dict(side="bottom", tickangle=-60, tickfont=dict(family=MONO_FONT, size=11), title="key",
                   constrain="domain"),
        yaxis=dict(autorange="reversed", tickfont=dict(family=MONO_FONT, size=11), title="query node",
                   scaleanchor="x", constrain="domain"),
    )
    return fig
