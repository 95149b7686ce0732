"""Token tries: nodes named by the token sequence that spells them from the root.

Two draft nodes are the same trie node when they spell the same tokens from the root.
Everything that shares prefixes between proposals builds one: the n-gram trie drafter
(several matches' continuations), the draft model's cache (which fed draft nodes spell
the accepted tokens) and SpecInfer's token-tree merge (Miao et al., ASPLOS'24), which
verifies several drafters' trees in one target call by merging them into one tree.

* :class:`TokenTrie` - the (parent, token) -> child table, nodes numbered in order of
  creation (so parents precede children);
* :func:`merge_trees_with_map` / :func:`merge_trees` - the token-tree merge.

The merged tree records, per node, the index of the first input tree that proposed it
(``source``) and the largest ``q`` any input gave it. Merged siblings may come from
different draft distributions, so the merged tree has no ``draft_probs``: verifiers
then treat it as deterministic (rule D), which stays exact for any set of distinct
sibling tokens.

Dimension legend: N = nodes of the merged tree including the root, T = input trees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specviz.tree.core import DraftTree

__all__ = ["TokenTrie", "MergedTree", "merge_trees", "merge_trees_with_map"]


class TokenTrie:
    """A token trie grown by inserting paths and trees under its root (node 0).

    Attributes:
        tokens: token id of every node, the root's first.
        parents: parent of every node (-1 for the root).
    """

    def __init__(self, root: int) -> None:
        self.tokens: list[int] = [int(root)]
        self.parents: list[int] = [-1]
        self._child: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int | None:
        """The child of ``node`` that holds ``token``, or None."""
        return self._child.get((node, token))

    def insert(self, node: int, token: int) -> int:
        """The child of ``node`` that holds ``token``, created if absent."""
        found = self._child.get((node, token))
        if found is not None:
            return found
        new = len(self.tokens)
        self._child[(node, token)] = new
        self.tokens.append(token)
        self.parents.append(node)
        return new

    def add_path(self, tokens: Sequence[int], node: int = 0) -> list[int]:
        """Insert the chain ``tokens`` below ``node``; returns the node of every token."""
        out = []
        for tok in tokens:
            node = self.insert(node, tok)
            out.append(node)
        return out

    def add_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """Insert a tree given as tokens plus a parent per node (node 0 its root, parents
        before children) with its root on the trie's root; returns the trie node of every
        tree node (the root's token is not compared)."""
        out = [0]
        for tok, parent in zip(tokens[1:], parents[1:]):
            out.append(self.insert(out[parent], tok))
        return out

    def walk(self, tokens: Sequence[int], node: int = 0) -> list[int]:
        """Nodes of the longest prefix of ``tokens`` that the trie spells below ``node``."""
        out = []
        for tok in tokens:
            node = self._child.get((node, tok))
            if node is None:
                break
            out.append(node)
        return out

    def children(self) -> list[list[int]]:
        """Children of every node, in order of creation."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        return kids


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

    trie = TokenTrie(root)
    source, q = [0], [1.0]  # per trie node
    trie_maps: list[list[int]] = []
    for t, tree in enumerate(trees):
        trie_map = trie.add_tree(tree.tokens.tolist(), tree.parents.tolist())
        tree_q = tree.q.tolist() if has_q else None
        for i, node in enumerate(trie_map[1:], 1):
            if node == len(source):  # created by this tree (nodes are numbered as created)
                source.append(t)
                q.append(tree_q[i] if has_q else 1.0)
            elif has_q:
                q[node] = max(q[node], tree_q[i])
        trie_maps.append(trie_map)

    children = trie.children()
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
        torch.tensor([trie.tokens[i] for i in order], dtype=torch.long),
        torch.tensor([-1] + [new_index[trie.parents[i]] for i in order[1:]], dtype=torch.long),
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
