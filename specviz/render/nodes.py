"""What the verifier did to each node of one draft tree, as plain data for the pictures.

The single place where node statuses, labels and per-node numbers are worked out; the
figures of :mod:`specviz.render.trees` (which re-exports every public name here) draw
what these functions return:

* :func:`tree_nodes` - one :class:`NodeInfo` per node of a step's draft tree (plus the
  bonus token);
* :func:`collapse_untried` - which untried nodes a large tree's picture folds into "+N"
  nodes (:class:`CollapsedNodes`);
* :func:`to_networkx` - that information as a ``networkx.DiGraph``;
* :func:`on_accepted_path` - the nodes the accepted path runs through.

Node statuses (:data:`STATUSES`): ``root`` (the last committed token), ``accepted``
(on the accepted path), ``bonus`` (the token the target adds after the accepted path;
not a node of the draft tree, drawn as an extra child of the last accepted node),
``rejected`` (tried by the verifier and refused), ``not chosen`` (not tried although its
parent was reached - the root or an accepted node: e.g. the siblings after the accepted
child under greedy verification, which stops at the first match), ``never reached``
(not tried because its parent was never accepted: everything below a rejected or
untried node) and ``drafted`` (a tree shown without a verification result).

Dimension legend: N = draft-tree nodes including the root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from specviz.render.text import escape_token, token_text
from specviz.tree.core import DraftTree, depths
from specviz.tree.shapes import TreeShape

if TYPE_CHECKING:
    import networkx as nx

    from specviz.verify.rules import Acceptance

__all__ = [
    "STATUSES",
    "UNTRIED",
    "NodeInfo",
    "CollapsedNodes",
    "tree_nodes",
    "collapse_untried",
    "on_accepted_path",
    "to_networkx",
]

#: every node status, in the order figures draw and list them
STATUSES: tuple[str, ...] = ("root", "accepted", "bonus", "rejected", "not chosen", "never reached", "drafted")
#: the statuses of nodes the verifier never tried
UNTRIED: tuple[str, ...] = ("not chosen", "never reached")


@dataclass(frozen=True)
class NodeInfo:
    """Everything the renderers show about one node.

    Attributes:
        index: node index in the draft tree; the bonus node gets index ``N``.
        parent: parent index (-1 for the root).
        token: token id (None for a :class:`~specviz.tree.shapes.TreeShape`, which has no tokens).
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
    """``values`` as one float per node (NaN becomes None), or None without values.

    Raises:
        ValueError: not exactly ``n`` values.
    """
    if values is None:
        return None
    t = torch.as_tensor(values, dtype=torch.float64).flatten().cpu()
    if t.numel() != n:
        raise ValueError(f"{name} must have one value per node ({n}), got {t.numel()}")
    return [None if math.isnan(v) else float(v) for v in t.tolist()]


def _check_acceptance(acceptance: "Acceptance", n: int) -> None:
    """Refuse an acceptance that belongs to another tree than one of ``n`` nodes."""
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


def on_accepted_path(nodes: Sequence[NodeInfo]) -> set[int]:
    """Indices of the nodes the accepted path runs through: the root, the accepted nodes
    and the bonus node."""
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
    on_path = on_accepted_path(nodes) if acceptance is not None else set()
    graph = nx.DiGraph()
    for v in nodes:
        graph.add_node(v.index, token=v.token, text=v.text, label=v.label, depth=v.depth,
                       rank=v.rank, q=v.q, p=v.p, accept_prob=v.accept_prob, status=v.status)
    for v in nodes[1:]:
        graph.add_edge(v.parent, v.index, accepted_path=v.index in on_path)
    return graph

