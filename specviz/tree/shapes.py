"""Static tree shapes: which ranked draft candidates a step drafts, before any token exists.

A :class:`TreeShape` says, for every node, who its parent is and which of the
parent's ranked draft candidates it takes (rank 0 = the draft's top-1). A drafter
fills a shape with tokens to get a :class:`specviz.tree.DraftTree`; the Sequoia
dynamic program (:mod:`specviz.tree.sequoia`) returns one; renderers draw one.

Constructors for the shapes in common use:

* :func:`chain` - ``k`` nodes in a line (classic speculative decoding);
* :func:`kary` - every node up to ``depth`` takes the top ``width`` candidates;
* :func:`expansion` - SpecInfer's expansion config, a branching factor per depth;
* :func:`from_paths` - Medusa's "choices": one rank tuple per node, e.g. ``(0, 1)``
  = the top-2 child of the top-1 child of the root.

Nodes are numbered so parents precede children and siblings appear in increasing
rank; the constructors use breadth-first order (all of depth 1, then depth 2, ...).

Dimension legend: N = number of nodes including the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from specviz.validate import check_int

__all__ = ["TreeShape", "chain", "kary", "expansion", "from_paths"]


@dataclass(frozen=True)
class TreeShape:
    """Parent index and candidate rank per node; node 0 is the root.

    Attributes:
        parents: ``parents[0] == -1`` and ``0 <= parents[i] < i`` for ``i >= 1``.
        ranks: ``ranks[0] == 0``; ``ranks[i] >= 0`` is which of the parent's ranked
            draft candidates node ``i`` takes (0 = top-1). Siblings have distinct
            ranks, increasing with node index.

    Raises:
        ValueError: on an empty shape, mismatched lengths, a bad root, a parent that
            is not before its child, a negative rank, or siblings whose ranks repeat
            or are out of order.
        TypeError: if an entry is not an int.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        parents = _int_tuple("parents", self.parents)
        ranks = _int_tuple("ranks", self.ranks)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "ranks", ranks)
        if not parents:
            raise ValueError("a tree shape needs at least the root node (got 0 nodes)")
        if len(ranks) != len(parents):
            raise ValueError(
                f"parents and ranks must have the same length, got {len(parents)} and {len(ranks)}"
            )
        if parents[0] != -1:
            raise ValueError(f"node 0 is the root and must have parent -1, got {parents[0]}")
        if ranks[0] != 0:
            raise ValueError(f"the root's rank must be 0, got {ranks[0]}")
        last_child_rank: dict[int, int] = {}
        for i in range(1, len(parents)):
            p, r = parents[i], ranks[i]
            if not 0 <= p < i:
                raise ValueError(
                    f"node {i} has parent {p}; every non-root node needs a parent with a "
                    f"smaller index (0 <= parent < {i})"
                )
            if r < 0:
                raise ValueError(f"node {i} has rank {r}; ranks must be >= 0")
            if p in last_child_rank and r <= last_child_rank[p]:
                raise ValueError(
                    f"node {i} has rank {r} but an earlier sibling (parent {p}) has rank "
                    f"{last_child_rank[p]}; sibling ranks must be distinct and increase with index"
                )
            last_child_rank[p] = r

    @property
    def n_nodes(self) -> int:
        """Number of nodes including the root."""
        return len(self.parents)

    @property
    def budget(self) -> int:
        """Number of draft nodes (root excluded)."""
        return len(self.parents) - 1

    @property
    def depth(self) -> int:
        """Length of the longest root-to-leaf path (0 for a root-only shape)."""
        return max(self.depths())

    @property
    def width(self) -> int:
        """Largest number of children of any node (0 for a root-only shape)."""
        counts = [0] * self.n_nodes
        for p in self.parents[1:]:
            counts[p] += 1
        return max(counts)

    def depths(self) -> tuple[int, ...]:
        """Depth of every node, root = 0."""
        out = [0] * self.n_nodes
        for i in range(1, self.n_nodes):
            out[i] = out[self.parents[i]] + 1
        return tuple(out)

    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Rank tuple from the root to every draft node, in node order (Medusa "choices")."""
        out: list[tuple[int, ...]] = [()]
        for i in range(1, self.n_nodes):
            out.append(out[self.parents[i]] + (self.ranks[i],))
        return tuple(out[1:])

    def parents_tensor(self) -> torch.Tensor:
        """``parents`` as a ``(N,)`` long tensor, the form :mod:`specviz.tree` takes."""
        return torch.tensor(self.parents, dtype=torch.long)

    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> "TreeShape":
        """Shape with the given parents; each node's rank is its position among its
        siblings (0 for the first child, 1 for the next, ...)."""
        parents = _int_tuple("parents", parents)
        seen: dict[int, int] = {}
        ranks = []
        for p in parents:
            ranks.append(seen.get(p, 0))
            seen[p] = ranks[-1] + 1
        return cls(parents, (0,) + tuple(ranks[1:]))


def _int_tuple(name: str, values: Iterable[int]) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = tuple(values)
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}[{i}] must be an int, got {v!r}")
    return out


def chain(k: int) -> TreeShape:
    """``k`` draft nodes in a line, each the top-1 candidate of the one before."""
    check_int("k", k, 0)
    return TreeShape((-1,) + tuple(range(k)), (0,) * (k + 1))


def expansion(branching: Sequence[int]) -> TreeShape:
    """SpecInfer expansion config: every node at depth ``d`` takes the top
    ``branching[d]`` candidates, e.g. ``[2, 2, 1]`` gives 2 + 4 + 4 = 10 draft nodes."""
    branching = list(branching)
    for d, b in enumerate(branching):
        check_int(f"branching[{d}]", b, 1)
    parents, ranks = [-1], [0]
    frontier = [0]
    for b in branching:
        nxt = []
        for u in frontier:
            for r in range(b):
                nxt.append(len(parents))
                parents.append(u)
                ranks.append(r)
        frontier = nxt
    return TreeShape(tuple(parents), tuple(ranks))


def kary(width: int, depth: int) -> TreeShape:
    """Full ``width``-ary tree of the given ``depth`` (``width**1 + ... + width**depth`` nodes)."""
    check_int("width", width, 1)
    check_int("depth", depth, 0)
    return expansion([width] * depth)


def from_paths(paths: Iterable[Sequence[int]]) -> TreeShape:
    """Shape from Medusa-style "choices": one tuple of ranks per draft node.

    The order of ``paths`` does not matter; nodes are numbered breadth-first with
    siblings by rank. Every proper prefix of a path must itself be listed (the
    empty path, the root, is implicit), and no path may repeat.

    Raises:
        ValueError: on an empty path, a negative rank, a duplicate, or a missing prefix.
        TypeError: on a rank that is not an int.
    """
    present: set[tuple[int, ...]] = set()
    for path in paths:
        t = _int_tuple("path", path)
        if not t:
            raise ValueError("paths must be non-empty; the root (empty path) is implicit")
        if min(t) < 0:
            raise ValueError(f"path {t} has a negative rank; ranks must be >= 0")
        if t in present:
            raise ValueError(f"path {t} is listed more than once")
        present.add(t)
    ordered = sorted(present, key=lambda t: (len(t), t))
    for t in ordered:
        if len(t) > 1 and t[:-1] not in present:
            raise ValueError(f"path {t} is listed but its parent path {t[:-1]} is not")
    index = {(): 0}
    parents, ranks = [-1], [0]
    for t in ordered:
        index[t] = len(parents)
        parents.append(index[t[:-1]])
        ranks.append(t[-1])
    return TreeShape(tuple(parents), tuple(ranks))
