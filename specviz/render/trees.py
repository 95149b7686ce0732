"""Pictures of one draft tree: its nodes coloured by what the verifier did, and its mask.

Everything here is a pure function from specviz objects to a graph or a figure, so
notebooks, the explorer widget (:mod:`specviz.render.explorer`) and saved files all draw
with the same code (whole generations: :mod:`specviz.render.steps`; files:
:mod:`specviz.render.export`):

* :func:`tree_nodes` - one :class:`NodeInfo` per node of a step's draft tree (plus the
  bonus token), the single place where statuses, labels and per-node numbers are
  worked out;
* :func:`to_networkx` - that information as a ``networkx.DiGraph``;
* :func:`tree_figure` / :func:`step_tree_figure` - the draft tree drawn with the tidy
  layout of :mod:`specviz.render.layout`, nodes coloured by status, accepted path emphasised;
* :func:`mask_figure` - the tree-attention mask as a heatmap labelled by node.

Node statuses (:data:`STATUSES`): ``root`` (the last committed token), ``accepted``
(on the accepted path), ``bonus`` (the token the target adds after the accepted path;
not a node of the draft tree, drawn as an extra child of the last accepted node),
``rejected`` (tried by the verifier and refused), ``never reached`` (never tried: its
parent was not reached, or a sibling tried before it was accepted) and ``drafted`` (a
tree shown without a verification result).

Dimension legend: N = draft-tree nodes including the root, P = committed prefix length.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from specviz.render.layout import tidy_layout
from specviz.tree.shapes import TreeShape
from specviz.tree.core import DraftTree, depths, tree_attention_mask

if TYPE_CHECKING:
    import networkx as nx
    import plotly.graph_objects as go

    from specviz.decode.records import StepTrace
    from specviz.verify.rules import Acceptance

__all__ = [
    "STATUSES",
    "STATUS_STYLE",
    "StatusStyle",
    "NodeInfo",
    "escape_token",
    "token_text",
    "tree_nodes",
    "to_networkx",
    "tree_figure",
    "step_tree_figure",
    "mask_figure",
    "figure_title",
    "plot_text",
]

STATUSES: tuple[str, ...] = ("root", "accepted", "bonus", "rejected", "never reached", "drafted")


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
    "never reached": StatusStyle("#999999", "circle-open", 13),
    "drafted": StatusStyle("#0072B2", "circle", 15),
}
_PATH_COLOR = STATUS_STYLE["accepted"].color
_EDGE_COLOR = "#BBBBBB"
MONO_FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"

_VISIBLE_WHITESPACE = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def escape_token(text: str, max_chars: int | None = 12) -> str:
    """Make a token's text readable as a label: whitespace and control characters become
    visible (``" "`` -> ``␣``, newline -> ``\\n``, tab -> ``\\t``, others -> ``\\xNN``), the
    empty string becomes ``∅``, and text longer than ``max_chars`` is cut with ``…``.

    The result is plain text; HTML escaping happens where figures are built.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if max_chars is not None and max_chars < 2:
        raise ValueError(f"max_chars must be >= 2 or None, got {max_chars}")
    if text == "":
        return "∅"
    parts = []
    for ch in text:
        if ch in _VISIBLE_WHITESPACE:
            parts.append(_VISIBLE_WHITESPACE[ch])
        elif not ch.isprintable():
            parts.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            parts.append(ch)
    out = "".join(parts)
    if max_chars is not None and len(out) > max_chars:
        out = out[: max_chars - 1] + "…"
    return out


def token_text(tokenizer: Any, token_id: int) -> str:
    """Decoded text of one token, or ``#id`` without a tokenizer."""
    if tokenizer is None:
        return f"#{int(token_id)}"
    return tokenizer.decode([int(token_id)])


@dataclass(frozen=True)
class NodeInfo:
    """Everything the renderers show about one node.

    Attributes:
        index: node index in the draft tree; the bonus node gets index ``N``.
        parent: parent index (-1 for the root).
        token: token id (None for a :class:`~specviz.shapes.TreeShape`, which has no tokens).
        text: decoded token text (or the rank, for a shape).
        label: ``text`` with whitespace made visible and cut to a short length.
        depth: distance from the root.
        rank: rank of the token in the draft distribution at its parent (0 = top-1), if known.
        q: draft probability of the token at its parent, if known.
        p: target probability of the token at its parent, if known.
        accept_prob: the acceptance probability the verifier used (None if not tried).
        status: one of :data:`STATUSES`.
    """

    index: int
    parent: int
    token: int | None
    text: str
    label: str
    depth: int
    rank: int | None
    q: float | None
    p: float | None
    accept_prob: float | None
    status: str


def _optional_floats(name: str, values: "torch.Tensor | Sequence[float] | None", n: int) -> list | None:
    if values is None:
        return None
    t = torch.as_tensor(values, dtype=torch.float64).flatten().cpu()
    if t.numel() != n:
        raise ValueError(f"{name} must have one value per node ({n}), got {t.numel()}")
    return [None if math.isnan(v) else float(v) for v in t.tolist()]


def _check_acceptance(acceptance: "Acceptance", n: int) -> None:
    if acceptance.tried.numel() != n:
        raise ValueError(
            f"the acceptance belongs to a tree with {acceptance.tried.numel()} nodes, "
            f"but the tree has {n}"
        )
    bad = [i for i in acceptance.accepted_nodes if not 0 < i < n]
    if bad:
        raise ValueError(f"accepted node {bad[0]} is not a draft node of a {n}-node tree")


def tree_nodes(tree: DraftTree | TreeShape, acceptance: "Acceptance | None" = None, *,
               tokenizer: Any = None,
               target_probs: "torch.Tensor | Sequence[float] | None" = None,
               max_label_chars: int = 12) -> tuple[NodeInfo, ...]:
    """Per-node information of a draft tree, plus the bonus node when ``acceptance`` is given.

    Args:
        tree: a draft tree, or a tree shape (drawn with rank labels, no tokens).
        acceptance: the verifier's result for this tree; without it every draft node has
            status ``drafted``.
        tokenizer: decodes token ids into labels (labels are ``#id`` without one).
        target_probs: ``(N,)`` target probability of each node's token at its parent
            (``StepTrace.target_token_probs``).
        max_label_chars: labels longer than this are cut.

    Returns:
        ``N`` (or ``N + 1`` with the bonus node) :class:`NodeInfo` in node order.

    Raises:
        TypeError: if ``tree`` is neither a DraftTree nor a TreeShape.
        ValueError: if ``acceptance`` or ``target_probs`` do not match the tree's size.
    """
    if isinstance(tree, TreeShape):
        parents = list(tree.parents)
        n = len(parents)
        tokens: list[int | None] = [None] * n
        texts = ["root"] + [f"top-{r + 1}" for r in tree.ranks[1:]]
        ranks: list[int | None] = list(tree.ranks)
        q = None
    elif isinstance(tree, DraftTree):
        parents = tree.parents.tolist()
        n = len(parents)
        tokens = tree.tokens.tolist()
        texts = [token_text(tokenizer, t) for t in tokens]
        ranks = tree.ranks.tolist() if tree.ranks is not None else [None] * n
        q = _optional_floats("q", tree.q, n)
    else:
        raise TypeError(f"tree must be a DraftTree or a TreeShape, got {type(tree).__name__}")
    p = _optional_floats("target_probs", target_probs, n)
    depth = depths(parents).tolist()

    if acceptance is None:
        status = ["root"] + ["drafted"] * (n - 1)
        accept_prob = [None] * n
    else:
        if isinstance(tree, TreeShape):
            raise TypeError("an acceptance belongs to a DraftTree, not a TreeShape")
        _check_acceptance(acceptance, n)
        accepted = set(acceptance.accepted_nodes)
        tried = acceptance.tried.tolist()
        status = ["root"] + [
            "accepted" if i in accepted else "rejected" if tried[i] else "never reached"
            for i in range(1, n)
        ]
        accept_prob = _optional_floats("node_accept_prob", acceptance.node_accept_prob, n)
        accept_prob[0] = None  # the root is committed, not tried

    nodes = [
        NodeInfo(index=i, parent=parents[i], token=tokens[i], text=texts[i],
                 label=escape_token(texts[i], max_label_chars), depth=depth[i], rank=ranks[i],
                 q=None if q is None or i == 0 else q[i], p=None if p is None or i == 0 else p[i],
                 accept_prob=accept_prob[i], status=status[i])
        for i in range(n)
    ]
    if acceptance is not None:
        last = acceptance.last_node
        text = token_text(tokenizer, acceptance.bonus_token)
        nodes.append(NodeInfo(index=n, parent=last, token=int(acceptance.bonus_token), text=text,
                              label=escape_token(text, max_label_chars), depth=depth[last] + 1,
                              rank=None, q=None, p=None, accept_prob=None, status="bonus"))
    return tuple(nodes)


def _on_accepted_path(nodes: Sequence[NodeInfo]) -> set[int]:
    return {v.index for v in nodes if v.status in ("root", "accepted", "bonus")}


def to_networkx(tree: DraftTree | TreeShape, acceptance: "Acceptance | None" = None, *,
                tokenizer: Any = None,
                target_probs: "torch.Tensor | Sequence[float] | None" = None) -> "nx.DiGraph":
    """The draft tree as a directed graph (edges parent -> child).

    Node keys are node indices (the bonus node is ``N``). Node attributes: ``token``,
    ``text``, ``label``, ``depth``, ``rank``, ``q``, ``p``, ``accept_prob``, ``status``
    (see :class:`NodeInfo`; unknown values are None). Edge attribute
    ``accepted_path``: True on the edges from the root through the accepted nodes to
    the bonus node. Arguments as in :func:`tree_nodes`.
    """
    import networkx as nx

    nodes = tree_nodes(tree, acceptance, tokenizer=tokenizer, target_probs=target_probs)
    on_path = _on_accepted_path(nodes) if acceptance is not None else set()
    graph = nx.DiGraph()
    for v in nodes:
        graph.add_node(v.index, token=v.token, text=v.text, label=v.label, depth=v.depth,
                       rank=v.rank, q=v.q, p=v.p, accept_prob=v.accept_prob, status=v.status)
    for v in nodes[1:]:
        graph.add_edge(v.parent, v.index, accepted_path=v.index in on_path)
    return graph


# -- plotly helpers ---------------------------------------------------------------------------

def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def plot_text(text: str) -> str:
    """``text`` made safe for plotly's text, labels and hovers: ``&``, ``<`` and ``>`` become
    entities, quotes stay as they are (plotly draws ``&quot;`` and ``&#x27;`` literally)."""
    return html.escape(text, quote=False)


def figure_title(text: str, **style) -> dict:
    """A plotly title from plain text: the first line is the title, further lines its
    subtitle (plotly places a subtitle correctly where a multi-line title drifts)."""
    first, _, rest = text.partition("\n")
    out = dict(text=plot_text(first), x=0.01, xanchor="left", font=dict(size=16), **style)
    if rest:
        out["subtitle"] = dict(text="<br>".join(plot_text(line) for line in rest.split("\n")),
                               font=dict(size=13))
    return out


def _hover(v: NodeInfo) -> str:
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


def _edge_xy(pairs: Sequence[tuple[int, int]], x: Sequence[float], y: Sequence[float]):
    xs: list[float | None] = []
    ys: list[float | None] = []
    for a, b in pairs:
        xs += [x[a], x[b], None]
        ys += [-y[a], -y[b], None]
    return xs, ys


def tree_figure(tree: DraftTree | TreeShape, acceptance: "Acceptance | None" = None, *,
                tokenizer: Any = None,
                target_probs: "torch.Tensor | Sequence[float] | None" = None,
                title: str | None = None, unit_px: int = 80, row_px: int = 80) -> "go.Figure":
    """Draw a draft tree: tidy layout, nodes coloured by status, accepted path emphasised.

    One marker trace per status present (so the legend lists exactly those), labels are
    the decoded tokens with visible whitespace (cut to fit; the hover has them whole), and hovering a node shows its rank, q,
    p, acceptance probability and depth. The figure grows with the tree (``unit_px``
    per node column, ``row_px`` per depth) instead of squeezing it, and opens in pan
    mode, so wide trees scroll and zoom rather than blur.

    Args:
        tree, acceptance, tokenizer, target_probs: as in :func:`tree_nodes`.
        title: figure title (default: node counts and the accepted length).
        unit_px: pixels between neighbouring nodes on a row.
        row_px: pixels between rows.

    Returns:
        A ``plotly.graph_objects.Figure``.
    """
    import plotly.graph_objects as go

    # labels sit right of their node, so they must fit in the gap to the next one
    nodes = tree_nodes(tree, acceptance, tokenizer=tokenizer, target_probs=target_probs,
                       max_label_chars=max(2, (unit_px - 24) // 7))
    lay = tidy_layout([v.parent for v in nodes])
    x, y = lay.x, lay.y
    on_path = _on_accepted_path(nodes) if acceptance is not None else set()

    fig = go.Figure()
    other = [(v.parent, v.index) for v in nodes[1:] if v.index not in on_path]
    path = [(v.parent, v.index) for v in nodes[1:] if v.index in on_path and v.status != "bonus"]
    bonus = [(v.parent, v.index) for v in nodes[1:] if v.status == "bonus"]
    for pairs, name, line in (
        (other, "draft edges", dict(color=_EDGE_COLOR, width=1.2)),
        (path, "accepted path", dict(color=_PATH_COLOR, width=5)),
        (bonus, "bonus edge", dict(color=STATUS_STYLE["bonus"].color, width=3, dash="dot")),
    ):
        if pairs:
            ex, ey = _edge_xy(pairs, x, y)
            fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=line, name=name,
                                     hoverinfo="skip", showlegend=name == "accepted path"))
    for status in STATUSES:
        members = [v for v in nodes if v.status == status]
        if not members:
            continue
        style = STATUS_STYLE[status]
        fig.add_trace(go.Scatter(
            x=[x[v.index] for v in members], y=[-y[v.index] for v in members],
            mode="markers+text", name=status,
            text=[plot_text(v.label) for v in members], textposition="middle right",
            textfont=dict(family=MONO_FONT, size=12, color="#222222"),
            marker=dict(color=style.color, symbol=style.symbol, size=style.size,
                        line=dict(color="#FFFFFF" if status != "never reached" else style.color,
                                  width=1.5 if status != "never reached" else 2)),
            hovertext=[_hover(v) for v in members], hoverinfo="text",
            customdata=[v.index for v in members],
        ))

    if title is None:
        title = f"draft tree: {len([v for v in nodes if v.status not in ('root', 'bonus')])} draft nodes"
        if acceptance is not None:
            title += f"\n{acceptance.accept_length} accepted + 1 bonus (tau {acceptance.tau})"
    pad, label_pad = 0.6, 1.0  # x units around the nodes; the right side also holds a label
    width = max(480, int(unit_px * (lay.width + pad + label_pad)) + 60)
    height = max(300, int(row_px * (lay.depth + 1)) + 190)
    # title on top, legend below the tree: neither can cover the other however narrow the figure
    fig.update_layout(
        title=figure_title(title),
        width=width, height=height, margin=dict(l=30, r=30, t=80, b=110),
        plot_bgcolor="white", paper_bgcolor="white", dragmode="pan", hovermode="closest",
        legend=dict(orientation="h", yanchor="top", y=-0.02, xanchor="left", x=0.0),
        xaxis=dict(visible=False, range=[-pad, lay.width + label_pad]),
        yaxis=dict(visible=False, range=[-lay.depth - pad, 0.8]),
    )
    return fig


def step_tree_figure(step: "StepTrace", *, tokenizer: Any = None, title: str | None = None) -> "go.Figure":
    """:func:`tree_figure` of one engine step (tree, acceptance and target probabilities)."""
    if title is None:
        acc = step.acceptance
        expected = step.expected_accept_length
        expected = "" if math.isnan(expected) else f" (expected {expected:.3f})"
        title = (f"step {step.step} · {step.drafter}\n{step.tree.budget} draft nodes, depth "
                 f"{step.tree.depth} · accepted {acc.accept_length}{expected} · tau {acc.tau}")
    return tree_figure(step.tree, step.acceptance, tokenizer=tokenizer,
                       target_probs=step.target_token_probs, title=title)


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
        cell_px: pixel size of one cell.
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
    n_rows, n_cols = len(rows), len(cols)
    fig.update_layout(
        title=figure_title(title or f"tree attention mask: {n_rows} nodes, prefix {prefix_len}\n"
                              "filled = may attend"),
        width=max(360, cell_px * n_cols + 180), height=max(300, cell_px * n_rows + 200),
        margin=dict(l=120, r=20, t=90, b=120), plot_bgcolor="white",
        xaxis=dict(side="bottom", tickangle=-60, tickfont=dict(family=MONO_FONT, size=11), title="key"),
        yaxis=dict(autorange="reversed", tickfont=dict(family=MONO_FONT, size=11), title="query node"),
    )
    return fig
