"""A deterministic tidy layout for drawing trees, in pure Python (no graphviz).

The layout follows Reingold and Tilford ("Tidier drawings of trees", 1981): every
subtree is drawn on its own, then sibling subtrees are pushed apart, left to right
in node-index order, until at every depth they share they are at least ``separation``
apart; a parent sits at the midpoint of its first and last child. That gives the
properties a reader relies on:

* each depth is one row (``y = depth``), the root on top;
* parents are centred over their children;
* children keep their node order (for draft trees: rank order), so edges never cross;
* two nodes on the same row are at least ``separation`` apart;
* the same parents always give the same drawing.

Subtrees are laid out bottom-up by walking nodes in decreasing index, which works
because every parent precedes its children; there is no recursion, so deep chains
are fine. The cost is ``O(N * D)``, instant for the 1 to a few hundred nodes a draft
tree has.

Dimension legend: N = number of nodes including the root, D = tree depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["TreeLayout", "tidy_layout"]


@dataclass(frozen=True)
class TreeLayout:
    """Node coordinates of a tidy drawing.

    Attributes:
        x: horizontal position per node; the leftmost node is at 0.
        y: row per node, equal to its depth (root = 0; draw with y growing downwards).
        separation: the minimum horizontal distance between nodes on one row.
    """

    x: tuple[float, ...]
    y: tuple[int, ...]
    separation: float

    @property
    def n_nodes(self) -> int:
        return len(self.x)

    @property
    def width(self) -> float:
        """Horizontal extent, rightmost minus leftmost x (0 for a chain)."""
        return max(self.x) - min(self.x)

    @property
    def depth(self) -> int:
        """Number of rows minus one."""
        return max(self.y)


def _parent_list(parents) -> list[int]:
    if isinstance(parents, torch.Tensor):
        if parents.dim() != 1:
            raise ValueError(f"parents must be 1-D, got shape {tuple(parents.shape)}")
        parents = parents.tolist()
    elif hasattr(parents, "parents"):  # a DraftTree or TreeShape
        return _parent_list(parents.parents)
    out = list(parents)
    if not out:
        raise ValueError("a tree needs at least the root node (got 0 nodes)")
    for i, p in enumerate(out):
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(f"parents[{i}] must be an int, got {p!r}")
    if out[0] != -1:
        raise ValueError(f"node 0 is the root and must have parent -1, got {out[0]}")
    for i in range(1, len(out)):
        if not 0 <= out[i] < i:
            raise ValueError(f"node {i} has parent {out[i]}; parents must satisfy 0 <= parent < {i}")
    return out


def tidy_layout(parents: "Sequence[int] | torch.Tensor", separation: float = 1.0) -> TreeLayout:
    """Lay out the tree given by ``parents`` (a sequence, ``(N,)`` tensor, ``DraftTree`` or
    ``TreeShape``; ``parents[0] == -1`` and ``parents[i] < i``).

    Args:
        parents: parent index per node.
        separation: minimum horizontal gap between nodes on the same row (> 0).

    Returns:
        A :class:`TreeLayout`.

    Raises:
        ValueError: on an empty tree, a bad root, a parent that does not precede its
            child, or a non-positive separation.
        TypeError: on a parent entry that is not an int.
    """
    if not separation > 0:
        raise ValueError(f"separation must be > 0, got {separation}")
    par = _parent_list(parents)
    n = len(par)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[par[i]].append(i)

    # Contours of the subtree under u, relative to u's x: left[u][k] / right[u][k] are the
    # leftmost / rightmost x among its nodes k rows below u (k = 0 is u itself).
    left: list[list[float]] = [[] for _ in range(n)]
    right: list[list[float]] = [[] for _ in range(n)]
    offset = [0.0] * n  # x of each node relative to its parent
    for u in range(n - 1, -1, -1):
        kids = children[u]
        if not kids:
            left[u], right[u] = [0.0], [0.0]
            continue
        # Place the kids' subtrees left to right; positions are relative to the first kid.
        row_left: list[float] = []
        row_right: list[float] = []
        placed: list[float] = []
        for c in kids:
            shift = 0.0
            if placed:
                shared = min(len(row_right), len(left[c]))
                shift = max(row_right[k] - left[c][k] + separation for k in range(shared))
            placed.append(shift)
            for k, (lo, hi) in enumerate(zip(left[c], right[c])):
                if k < len(row_left):
                    row_left[k] = min(row_left[k], shift + lo)
                    row_right[k] = max(row_right[k], shift + hi)
                else:
                    row_left.append(shift + lo)
                    row_right.append(shift + hi)
        centre = (placed[0] + placed[-1]) / 2.0
        for c, shift in zip(kids, placed):
            offset[c] = shift - centre
        left[u] = [0.0] + [v - centre for v in row_left]
        right[u] = [0.0] + [v - centre for v in row_right]
        # The children's contours are merged into u's; free them as we go.
        for c in kids:
            left[c], right[c] = [], []

    x = [0.0] * n
    y = [0] * n
    for i in range(1, n):
        x[i] = x[par[i]] + offset[i]
        y[i] = y[par[i]] + 1
    lo = min(x)
    return TreeLayout(tuple(v - lo for v in x), tuple(y), float(separation))
