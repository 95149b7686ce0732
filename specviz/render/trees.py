"""Pictures of one draft tree: its nodes coloured by what the verifier did, and its mask.

Everything here is a pure function from specviz objects to a graph or a figure, so
notebooks, the explorer widget (:mod:`specviz.render.explorer`) and saved files all draw
with the same code (whole generations: :mod:`specviz.render.steps`; files:
:mod:`specviz.render.export`):

* :func:`tree_nodes` - one :class:`NodeInfo` per node of a step's draft tree (plus the
  bonus token), the single place where statuses, labels and per-node numbers are
  worked out;
* :func:`to_networkx` - that information as a ``networkx.DiGraph``;
* :func:`collapse_untried` - which untried nodes a large tree's picture folds into "+N" nodes;
* :func:`tree_figure` / :func:`step_tree_figure` - the draft tree drawn with the tidy
  layout of :mod:`specviz.render.layout`, nodes coloured by status, accepted path
  emphasised, filling the width of its notebook cell or page;
* :func:`mask_figure` - the tree-attention mask as a heatmap labelled by node.

Node statuses (:data:`STATUSES`): ``root`` (the last committed token), ``accepted``
(on the accepted path), ``bonus`` (the token the target adds after the accepted path;
not a node of the draft tree, drawn as an extra child of the last accepted node),
``rejected`` (tried by the verifier and refused), ``not chosen`` (not tried although its
parent was reached - the root or an accepted node: e.g. the siblings after the accepted
child under greedy verification, which stops at the first match), ``never reached``
(not tried because its parent was never accepted: everything below a rejected or
untried node) and ``drafted`` (a tree shown without a verification result).

Every text that reaches plotly (labels, hovers, titles, tick labels) goes through
:func:`plot_text`, so token text is shown as it is: quotes stay quotes and ``<b>`` is
not read as markup.

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

STATUSES: tuple[str, ...] = ("root", "accepted", "bonus", "rejected", "not chosen", "never reached", "drafted")
#: the statuses of nodes the verifier never tried
UNTRIED: tuple[str, ...] = ("not chosen", "never reached")


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
               max_label_chars: int | None = 12) -> tuple[NodeInfo, ...]:
    """Per-node information of a draft tree, plus the bonus node when ``acceptance`` is given.

    Args:
        tree: a draft tree, or a tree shape (drawn with rank labels, no tokens).
        acceptance: the verifier's result for this tree; without it every draft node has
            status ``drafted``. With it, untried nodes are ``not chosen`` when their parent
            is the root or accepted and ``never reached`` otherwise.
        tokenizer: decodes token ids into labels (labels are ``#id`` without one).
        target_probs: ``(N,)`` target probability of each node's token at its parent
            (``StepTrace.target_token_probs``).
        max_label_chars: labels longer than this are cut (None: never).

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
        reached = accepted | {0}  # nodes whose children the verifier could try
        status = ["root"] + [
            "accepted" if i in accepted else "rejected" if tried[i]
            else "not chosen" if parents[i] in reached else "never reached"
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


@dataclass(frozen=True)
class CollapsedNodes:
    """Untried nodes that a picture folds into one "+N" node under a tried node.

    Attributes:
        parent: index of the node they hang from (the root, an accepted or a rejected node).
        members: indices of the hidden nodes, in node order (N = ``len(members)``).
        not_chosen: how many of them are ``not chosen`` (the rest are ``never reached``).
        labels: the labels of the hidden children of ``parent``, in node order.
    """

    parent: int
    members: tuple[int, ...]
    not_chosen: int
    labels: tuple[str, ...]

    @property
    def size(self) -> int:
        """N, the number of hidden nodes."""
        return len(self.members)


def collapse_untried(nodes: Sequence[NodeInfo], min_size: int = 2
                     ) -> tuple[tuple[NodeInfo, ...], tuple[CollapsedNodes, ...]]:
    """Fold the untried parts of a verified tree into "+N" nodes.

    Under every tried node (the root, accepted and rejected nodes), the untried children
    and everything below them - subtrees that hold no tried node - become one
    :class:`CollapsedNodes` if they are at least ``min_size`` nodes. The accepted path,
    the bonus node and every tried node always stay.

    Args:
        nodes: :func:`tree_nodes` of a tree with an acceptance.
        min_size: the smallest group worth folding (>= 1; 2 keeps single untried leaves).

    Returns:
        ``(kept, groups)``: the nodes still drawn, in node order, and the groups, in the
        order of their parents.

    Raises:
        ValueError: if ``nodes`` carry no verification result (no node is accepted,
            rejected or untried, only ``drafted``), or ``min_size`` < 1.
    """
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")
    if any(v.status == "drafted" for v in nodes):
        raise ValueError("only a verified tree can be collapsed: these nodes carry no acceptance "
                         "(status 'drafted'), so nothing was tried")
    children: list[list[int]] = [[] for _ in nodes]
    for v in nodes[1:]:
        children[v.parent].append(v.index)
    hidden: set[int] = set()
    groups: list[CollapsedNodes] = []
    for v in nodes:
        if v.status not in ("root", "accepted", "rejected"):
            continue
        heads = [c for c in children[v.index] if nodes[c].status in UNTRIED]
        members, stack = [], list(heads)
        while stack:
            u = stack.pop()
            members.append(u)
            stack.extend(children[u])
        if len(members) >= min_size:
            members.sort()
            hidden.update(members)
            groups.append(CollapsedNodes(
                parent=v.index, members=tuple(members),
                not_chosen=sum(nodes[u].status == "not chosen" for u in members),
                labels=tuple(nodes[c].label for c in heads)))
    return tuple(v for v in nodes if v.index not in hidden), tuple(groups)


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
    """``text`` made safe for plotly's text, labels, hovers, titles and tick labels.

    plotly reads its text as a small HTML subset, decodes only a few entities (``&amp;``,
    ``&lt;``, ``&gt;`` and numeric ones) and draws any other, such as ``&quot;``, as
    written. So ``&``, ``<`` and ``>`` become entities (a token ``<b>`` is shown, not
    obeyed) and quotes stay characters.

    Raises:
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"plot text must be a str, got {type(text).__name__}")
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


def _group_hover(g: CollapsedNodes, parent: NodeInfo) -> str:
    shown = ", ".join(plot_text(_label(label, 12)) for label in g.labels[:8]) + (" …" if len(g.labels) > 8 else "")
    below = f"below node {g.parent} ({plot_text(parent.label)}, {parent.status})"
    return "<br>".join([
        f"<b>+{g.size} untried nodes</b> {below}",
        f"{g.not_chosen} not chosen · {g.size - g.not_chosen} never reached",
        f"children: {shown}",
        "draw with collapse=False to see them",
    ])


def _edge_xy(pairs: Sequence[tuple[int, int]], x: Sequence[float], y: Sequence[float]):
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

    if isinstance(width_hint, bool) or not isinstance(width_hint, int) or width_hint < 200:
        raise ValueError(f"width_hint must be an int >= 200 (px), got {width_hint!r}")
    if isinstance(row_px, bool) or not isinstance(row_px, int) or row_px < 20:
        raise ValueError(f"row_px must be an int >= 20 (px), got {row_px!r}")
    if collapse and acceptance is None:
        raise ValueError("collapse=True needs an acceptance: without one no node was tried, "
                         "so there are no untried subtrees to fold")
    nodes = tree_nodes(tree, acceptance, tokenizer=tokenizer, target_probs=target_probs,
                       max_label_chars=None)
    if collapse is None:
        collapse = acceptance is not None and len(nodes) - 1 > COLLAPSE_ABOVE
    kept, groups = collapse_untried(nodes) if collapse else (nodes, ())

    # layout of what is drawn: kept nodes (in node order), then one "+N" node per group
    where = {v.index: k for k, v in enumerate(kept)}
    parents = [-1] + [where[v.parent] for v in kept[1:]] + [where[g.parent] for g in groups]
    lay = tidy_layout(parents)
    x, y = lay.x, lay.y
    size = _sizing(lay.width, width_hint)
    on_path = _on_accepted_path(nodes) if acceptance is not None else set()

    fig = go.Figure()
    other = [(where[v.parent], where[v.index]) for v in kept[1:] if v.index not in on_path]
    path = [(where[v.parent], where[v.index]) for v in kept[1:]
            if v.index in on_path and v.status != "bonus"]
    bonus = [(where[v.parent], where[v.index]) for v in kept[1:] if v.status == "bonus"]
    folded = [(where[g.parent], len(kept) + k) for k, g in enumerate(groups)]
    for pairs, name, line in (
        (other, "draft edges", dict(color=_EDGE_COLOR, width=1.2)),
        (folded, "collapsed edges", dict(color=_EDGE_COLOR, width=1.2, dash="dot")),
        (path, "accepted path", dict(color=_PATH_COLOR, width=5)),
        (bonus, "bonus edge", dict(color=STATUS_STYLE["bonus"].color, width=3, dash="dot")),
    ):
        if pairs:
            ex, ey = _edge_xy(pairs, x, y)
            fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=line, name=name,
                                     hoverinfo="skip", showlegend=name == "accepted path"))
    textfont = dict(family=MONO_FONT, size=size["font"], color="#222222")
    for status in STATUSES:
        members = [v for v in kept if v.status == status]
        if not members:
            continue
        style = STATUS_STYLE[status]
        is_open = style.symbol.endswith("-open")
        fig.add_trace(go.Scatter(
            x=[x[where[v.index]] for v in members], y=[-y[where[v.index]] for v in members],
            mode="markers+text", name=status,
            text=[plot_text(_label(v.label, size["chars"])) for v in members],
            textposition=size["position"], textfont=textfont,
            marker=dict(color=style.color, symbol=style.symbol,
                        size=max(5, round(style.size * size["scale"])),
                        line=dict(color=style.color if is_open else "#FFFFFF", width=2 if is_open else 1.5)),
            hovertext=[_hover(v) for v in members], hoverinfo="text",
            customdata=[v.index for v in members],
        ))
    if groups:
        fig.add_trace(go.Scatter(
            x=[x[len(kept) + k] for k in range(len(groups))],
            y=[-y[len(kept) + k] for k in range(len(groups))],
            mode="markers+text", name="+N untried nodes (collapsed)",
            text=[f"+{g.size}" for g in groups], textposition=size["position"], textfont=textfont,
            marker=dict(color=COLLAPSED_STYLE.color, symbol=COLLAPSED_STYLE.symbol,
                        size=max(5, round(COLLAPSED_STYLE.size * size["scale"])),
                        line=dict(color=COLLAPSED_STYLE.color, width=2)),
            hovertext=[_group_hover(g, nodes[g.parent]) for g in groups], hoverinfo="text",
            customdata=[g.parent for g in groups],
        ))

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
    return fig


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
