"""Static shapes at an exact draft budget, one per family, for sweeps over budgets.

* :func:`first_nodes` - a breadth-first shape cut to a budget;
* :func:`budgeted_kary` - the first ``budget`` nodes of a k-ary tree, built without the
  full tree (``width ** depth`` nodes would not fit in memory for wide, deep settings);
* :func:`budget_shapes` - chain, complete 2-ary and 4-ary trees, SpecInfer's expansion
  ``[3, 2, 1, ...]`` and Sequoia's optimal tree, each with exactly the budget;
* :func:`shape_key` - a short stable id of a shape for result stores.

Dimension legend: N = nodes including the root.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from specviz.tree.sequoia import sequoia_tree
from specviz.tree.shapes import TreeShape, chain, expansion, kary
from specviz.validate import check_int

__all__ = ["SHAPE_FAMILIES", "first_nodes", "budgeted_kary", "shape_key", "budget_shapes"]


#: The static shape families :func:`budget_shapes` builds, in the order it returns them.
SHAPE_FAMILIES: tuple[str, ...] = ("chain", "2-ary", "4-ary", "expansion-3-2-1", "sequoia")


def first_nodes(shape: TreeShape, n: int) -> TreeShape:
    """The first ``n`` draft nodes of ``shape`` (root kept): a breadth-first shape cut to
    an exact budget. Parents precede children, so any prefix is a tree.

    Raises:
        ValueError: if ``shape`` has fewer than ``n`` draft nodes.
    """
    check_int("n", n, 0)
    if n > shape.budget:
        raise ValueError(f"the shape has {shape.budget} draft nodes, fewer than the {n} requested")
    return TreeShape(shape.parents[:n + 1], shape.ranks[:n + 1])


def budgeted_kary(width: int, depth: int, budget: int) -> TreeShape:
    """The first ``budget`` nodes, breadth first, of the full ``width``-ary tree of ``depth``:
    the top-``width`` candidates at every node, shallow levels filled first."""
    check_int("width", width)
    check_int("depth", depth)
    check_int("budget", budget)
    parents, ranks, level_of = [-1], [0], [0]
    u = 0
    while len(parents) <= budget and u < len(parents):
        if level_of[u] < depth:
            for r in range(width):
                if len(parents) > budget:
                    break
                parents.append(u)
                ranks.append(r)
                level_of.append(level_of[u] + 1)
        u += 1
    return TreeShape(tuple(parents), tuple(ranks))


def shape_key(shape: TreeShape) -> str:
    """A short stable id of a shape's parents and ranks (for unit ids of result stores)."""
    text = ",".join(map(str, shape.parents)) + "|" + ",".join(map(str, shape.ranks))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _levels(width: int, budget: int) -> int:
    """Depth of a complete ``width``-ary tree with at least ``budget`` draft nodes."""
    depth, total, level = 0, 0, 1
    while total < budget:
        depth += 1
        level *= width
        total += level
    return depth


def budget_shapes(budget: int, acceptance: Sequence[float] | None = None, *,
                  sequoia_max_depth: int = 8) -> dict[str, TreeShape]:
    """One static shape per family of :data:`SHAPE_FAMILIES` with exactly ``budget`` draft nodes.

    * ``chain`` - ``chain(budget)``;
    * ``2-ary``, ``4-ary`` - complete k-ary trees cut breadth-first to the budget;
    * ``expansion-3-2-1`` - SpecInfer expansion ``[3, 2, 1, 1, ...]`` (three candidates at
      depth 1, two under each at depth 2, then chains), cut breadth-first;
    * ``sequoia`` - Sequoia's optimal tree for ``acceptance`` (only when given) and
      depth limit ``sequoia_max_depth`` (raised as far as needed to fit the budget).

    Raises:
        ValueError: on a budget below 1.
    """
    check_int("budget", budget)
    # [3, 2] holds 9 draft nodes and every further level of the chains adds 6.
    chains = max(0, -(-(budget - 9) // 6))
    out = {
        "chain": chain(budget),
        "2-ary": first_nodes(kary(2, _levels(2, budget)), budget),
        "4-ary": first_nodes(kary(4, _levels(4, budget)), budget),
        "expansion-3-2-1": first_nodes(expansion([3, 2] + [1] * chains), budget),
    }
    if acceptance is not None:
        k = len(acceptance)
        depth = max(sequoia_max_depth, 1)
        while sum(k ** d for d in range(1, depth + 1)) < budget:
            depth += 1
        out["sequoia"] = sequoia_tree(acceptance, budget, depth).shape
    return out
