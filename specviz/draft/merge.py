"""Merging several draft trees into one token tree (SpecInfer's token-tree merge).

Several drafters (two draft models, a model and an n-gram table, ...) each propose a
tree rooted at the same committed token. SpecInfer (Miao et al., ASPLOS'24) verifies
them all in one target call by merging them into a single *token tree*: two nodes
are the same node when they spell the same token sequence from the root, so common
prefixes are shared and every distinct path is kept once.

The merged tree records, per node, the index of the first input tree that proposed
it (``source``) and the largest ``q`` any input gave it. Merged siblings may come
from different draft distributions, so the merged tree has no ``draft_probs``:
verifiers then treat it as deterministic (rule D), which stays exact for any set of
distinct sibling tokens.

Dimension legend: N = nodes of the merged tree including the root, T = input trees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specviz.tree.core import DraftTree

__all__ = ["MergedTree", "merge_trees", "merge_trees_with_map"]


@dataclass(frozen=True)
class MergedTree:
    """A merged token tree plus where every input node went.

    Attributes:
        tree: the merged :class:`~specviz.tree.DraftTree`.
        node_maps: ``node_maps[t][i]`` is the merged node index of node ``i`` of input
            tree ``t`` (duplicate sibling tokens inside one input map to one node).
    """

    tree: DraftTree
    node_maps: tuple[tuple[int, ...], ...]


def merge_trees_with_map(trees: Sequence[DraftTree]) -> MergedTree:
    """Merge ``trees`` (same root token) into one token tree and report the node mapping.

    Node order of the result: breadth first from the root; siblings sorted by merged
    ``q`` (largest first), ties broken by first appearance (earlier tree, then earlier
    node), or by first appearance alone when ``q`` is absent. Parents therefore precede
    children and ``ranks[i]`` is node ``i``'s position among its siblings.

    Args:
        trees: ``T >= 1`` draft trees whose roots hold the same token.

    Returns:
        A :class:`MergedTree`. Its tree has ``source`` = index of the first input tree
        containing the node (0 for the root), ``q`` = the maximum ``q`` over the input
        nodes merged into it (``None`` unless every input has ``q``), ``ranks`` as
        above and ``draft_probs = None``.

    Raises:
        TypeError: if an input is not a ``DraftTree``.
        ValueError: on an empty list or roots with different tokens.
    """
    if len(trees) == 0:
        raise ValueError("merge_trees needs at least one tree")
    for t, tree in enumerate(trees):
        if not isinstance(tree, DraftTree):
            raise TypeError(f"trees[{t}] must be a DraftTree, got {type(tree).__name__}")
    root = int(trees[0].tokens[0])
    for t, tree in enumerate(trees):
        if int(tree.tokens[0]) != root:
            raise ValueError(
                f"all trees must share the root token; trees[0] has {root}, "
                f"trees[{t}] has {int(tree.tokens[0])}"
            )
    has_q = all(tree.q is not None for tree in trees)

    # token trie in order of first appearance; trie node 0 is the root
    tokens, parents, source, q = [root], [-1], [0], [1.0]
    child_of: dict[tuple[int, int], int] = {}
    trie_maps: list[list[int]] = []
    for t, tree in enumerate(trees):
        tree_tokens = tree.tokens.tolist()
        tree_parents = tree.parents.tolist()
        tree_q = tree.q.tolist() if has_q else None
        trie_map = [0]
        for i in range(1, len(tree_tokens)):
            parent = trie_map[tree_parents[i]]
            node = child_of.get((parent, tree_tokens[i]))
            if node is None:
                node = len(tokens)
                child_of[(parent, tree_tokens[i])] = node
                tokens.append(tree_tokens[i])
                parents.append(parent)
                source.append(t)
                q.append(tree_q[i] if has_q else 1.0)
            elif has_q:
                q[node] = max(q[node], tree_q[i])
            trie_map.append(node)
        trie_maps.append(trie_map)

    children: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]].append(i)
    if has_q:
        for kids in children:
            kids.sort(key=lambda i: (-q[i], i))

    # breadth-first renumbering
    order = [0]
    for node in order:  # grows while iterating: a queue without pops
        order.extend(children[node])
    new_index = {old: new for new, old in enumerate(order)}
    ranks = [0] * len(order)
    for kids in children:
        for r, kid in enumerate(kids):
            ranks[new_index[kid]] = r

    tree = DraftTree(
        torch.tensor([tokens[i] for i in order], dtype=torch.long),
        torch.tensor([-1] + [new_index[parents[i]] for i in order[1:]], dtype=torch.long),
        q=torch.tensor([q[i] for i in order], dtype=torch.float32) if has_q else None,
        ranks=torch.tensor(ranks, dtype=torch.long),
        source=torch.tensor([source[i] for i in order], dtype=torch.long),
    )
    node_maps = tuple(tuple(new_index[i] for i in m) for m in trie_maps)
    return MergedTree(tree, node_maps)


def merge_trees(trees: Sequence[DraftTree]) -> DraftTree:
    """Merge ``trees`` (same root token) into one token tree sharing common prefixes.

    See :func:`merge_trees_with_map` for the node order, ``source``, ``q`` and
    ``ranks`` of the result.
    """
    return merge_trees_with_map(trees).tree
