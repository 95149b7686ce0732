"""Draft trees: one representation, everything else derived.

A draft tree is the set of tokens a drafter proposes in one speculative step.
It is stored as two aligned vectors:

* ``tokens[i]``  - the token id at node ``i``;
* ``parents[i]`` - the index of node ``i``'s parent, with ``parents[0] == -1``.

Node 0 is the *root*: the last committed token, not a draft. Every other node
has a parent with a smaller index, so ``range(n_nodes)`` is a topological order.
Depths, root-to-leaf paths, ancestor masks, position ids and padded batches are
derived from ``parents`` by the small pure functions below; nothing derived is
stored beside it. The tree algorithms that drafters, verifiers and replays share live
here too: children lists (optionally trimmed to a depth), the greedy walk
(:func:`greedy_walk`) and padded batch masks (:func:`pad_masks`).

Optional per-node draft information (used by the sampling verifiers and by the
renderers):

* ``q[i]``     - draft probability of ``tokens[i]`` under the draft distribution at
  ``parents[i]`` (``q[0]`` is 1.0);
* ``ranks[i]`` - rank of ``tokens[i]`` in that draft distribution (0 = top-1);
* ``draft_probs[u]`` - the full draft distribution at node ``u`` from which its
  children were drawn, shape ``(n_nodes, vocab)``; rows of nodes with no
  children may be zero.

Dimension legend: N = number of nodes including the root, V = vocabulary size,
B = batch size, P = committed prefix length (KV cache length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from specviz.tree.shapes import TreeShape

if TYPE_CHECKING:
    from specviz.tree.side import SideBranch

__all__ = [
    "DraftTree",
    "depths",
    "children_lists",
    "greedy_walk",
    "leaves",
    "root_to_leaf_paths",
    "path_to",
    "ancestor_mask",
    "position_ids",
    "tree_attention_mask",
    "pad_masks",
    "TreeBatch",
    "forward_mask",
    "pad_trees",
]


def _as_long_vector(name: str, value) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D sequence, got shape {tuple(t.shape)}")
    if t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    return t.to(torch.long).cpu()


@dataclass(frozen=True)
class DraftTree:
    """Token ids plus a parent index per node; node 0 is the root.

    Args:
        tokens: ``(N,)`` token ids; ``tokens[0]`` is the last committed token.
        parents: ``(N,)`` parent indices with ``parents[0] == -1`` and
            ``0 <= parents[i] < i`` for ``i >= 1``.
        q: optional ``(N,)`` draft probability of each node's token at its parent.
        ranks: optional ``(N,)`` rank of each node's token in the draft distribution.
        draft_probs: optional ``(N, V)`` draft distribution at each node (over its
            children).
        source: optional ``(N,)`` small int per node naming which drafter proposed it
            (used by merged trees; 0 when there is a single drafter).

    Raises:
        ValueError: on an empty tree, mismatched lengths, a root that is not
            ``-1``-parented, or a parent that is not before its child (which also
            rules out cycles).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    source: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens = _as_long_vector("tokens", self.tokens)
        parents = _as_long_vector("parents", self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        n = tokens.numel()
        if n == 0:
            raise ValueError("a draft tree needs at least the root node (got 0 nodes)")
        if parents.numel() != n:
            raise ValueError(
                f"tokens and parents must have the same length, got {n} and {parents.numel()}"
            )
        if int(parents[0]) != -1:
            raise ValueError(f"node 0 is the root and must have parent -1, got {int(parents[0])}")
        if n > 1:
            idx = torch.arange(1, n)
            bad = (parents[1:] < 0) | (parents[1:] >= idx)
            if bool(bad.any()):
                i = int(idx[bad][0])
                raise ValueError(
                    f"node {i} has parent {int(parents[i])}; every non-root node needs a parent "
                    f"with a smaller index (0 <= parent < {i}), which also excludes cycles"
                )
        if bool((tokens < 0).any()):
            i = int(torch.nonzero(tokens < 0)[0])
            raise ValueError(f"token ids must be >= 0, node {i} has {int(tokens[i])}")
        if self.q is not None:
            q = torch.as_tensor(self.q, dtype=torch.float32).cpu()
            if q.shape != (n,):
                raise ValueError(f"q must have shape ({n},), got {tuple(q.shape)}")
            object.__setattr__(self, "q", q)
        if self.ranks is not None:
            ranks = _as_long_vector("ranks", self.ranks)
            if ranks.numel() != n:
                raise ValueError(f"ranks must have length {n}, got {ranks.numel()}")
            object.__setattr__(self, "ranks", ranks)
        if self.draft_probs is not None:
            dp = torch.as_tensor(self.draft_probs)
            if dp.dim() != 2 or dp.shape[0] != n:
                raise ValueError(f"draft_probs must have shape ({n}, V), got {tuple(dp.shape)}")
        if self.source is not None:
            src = _as_long_vector("source", self.source)
            if src.numel() != n:
                raise ValueError(f"source must have length {n}, got {src.numel()}")
            object.__setattr__(self, "source", src)

    # -- convenience -----------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        """Number of nodes including the root."""
        return int(self.tokens.numel())

    @property
    def budget(self) -> int:
        """Number of draft nodes (root excluded)."""
        return self.n_nodes - 1

    @property
    def depth(self) -> int:
        """Length of the longest root-to-leaf path (0 for a root-only tree)."""
        return int(depths(self.parents).max())

    @classmethod
    def from_lists(cls, tokens: Sequence[int], parents: Sequence[int], **kw) -> "DraftTree":
        """Build a tree from plain Python lists."""
        return cls(torch.tensor(list(tokens), dtype=torch.long),
                   torch.tensor(list(parents), dtype=torch.long), **kw)

    def subtree(self, keep: Iterable[int]) -> "DraftTree":
        """Return the tree restricted to ``keep`` (must contain the root and be
        closed under parents); nodes keep their relative order."""
        keep_idx = sorted(set(int(k) for k in keep))
        if not keep_idx or keep_idx[0] != 0:
            raise ValueError("subtree must keep the root (node 0)")
        remap = {old: new for new, old in enumerate(keep_idx)}
        new_parents = [-1]
        for old in keep_idx[1:]:
            p = int(self.parents[old])
            if p not in remap:
                raise ValueError(f"subtree keeps node {old} but not its parent {p}")
            new_parents.append(remap[p])
        sel = torch.tensor(keep_idx, dtype=torch.long)
        return DraftTree(
            self.tokens[sel],
            torch.tensor(new_parents, dtype=torch.long),
            q=None if self.q is None else self.q[sel],
            ranks=None if self.ranks is None else self.ranks[sel],
            draft_probs=None if self.draft_probs is None else self.draft_probs[sel],
            source=None if self.source is None else self.source[sel],
        )


# -- derived quantities (pure functions of `parents`) ---------------------------------

def _parents_of(tree_or_parents) -> torch.Tensor:
    """Parents of a :class:`DraftTree`, a :class:`~specviz.tree.shapes.TreeShape` or a parent vector."""
    if isinstance(tree_or_parents, DraftTree):
        return tree_or_parents.parents
    if isinstance(tree_or_parents, TreeShape):
        return _as_long_vector("parents", tree_or_parents.parents)
    return _as_long_vector("parents", tree_or_parents)


def depths(tree_or_parents) -> torch.Tensor:
    """Depth of every node, root = 0. Shape ``(N,)``."""
    parents = _parents_of(tree_or_parents)
    out = torch.zeros(parents.numel(), dtype=torch.long)
    pl = parents.tolist()
    for i in range(1, len(pl)):
        out[i] = out[pl[i]] + 1
    return out


def children_lists(tree_or_parents, max_depth: int | None = None) -> list[list[int]]:
    """``children[u]`` = node indices whose parent is ``u``, in index order.

    Args:
        tree_or_parents: a tree, a shape or a parent vector.
        max_depth: leave out nodes deeper than this (a tree trimmed to the room a step
            has left); None keeps every node.
    """
    parents = _parents_of(tree_or_parents)
    pl = parents.tolist()
    keep = [True] * len(pl) if max_depth is None else (depths(parents) <= max_depth).tolist()
    children: list[list[int]] = [[] for _ in pl]
    for i in range(1, len(pl)):
        if keep[i]:
            children[pl[i]].append(i)
    return children


def greedy_walk(children: Sequence[Sequence[int]], labels: Sequence[int], wanted: Callable[[int, int], int],
                on_try: Callable[[int, bool], None] | None = None) -> tuple[list[int], int]:
    """The accepted path of greedy verification, for any source of the target's choice.

    From the root, at each reached node ``u`` at depth ``d``, the walk takes the first
    child (in ``children[u]`` order) whose label is ``wanted(u, d)`` and stops at the
    first node where no child has it. Labels are tokens when ``wanted`` gives the
    target's argmax or a recorded continuation, or candidate ranks when it gives the
    rank of the target's token in the draft (a static shape).

    Args:
        children: :func:`children_lists` of the tree.
        labels: one label per node.
        wanted: ``(node, depth) -> label`` the target picks after ``node``.
        on_try: called as ``on_try(child, hit)`` for every child compared, in order.

    Returns:
        ``(path, last)``: the accepted nodes (root excluded) and the label wanted at the
        node where the walk stopped (the greedy bonus token when labels are tokens).
    """
    path: list[int] = []
    u = 0
    while True:
        want = wanted(u, len(path))
        chosen = None
        for s in children[u]:
            hit = labels[s] == want
            if on_try is not None:
                on_try(s, hit)
            if hit:
                chosen = s
                break
        if chosen is None:
            return path, want
        path.append(chosen)
        u = chosen


def leaves(tree_or_parents) -> list[int]:
    """Indices of nodes with no children (the root alone is a leaf of a root-only tree)."""
    return [i for i, c in enumerate(children_lists(tree_or_parents)) if not c]


def path_to(tree_or_parents, node: int) -> list[int]:
    """Node indices from the root to ``node`` inclusive."""
    parents = _parents_of(tree_or_parents).tolist()
    if not 0 <= node < len(parents):
        raise ValueError(f"node {node} is out of range for a tree with {len(parents)} nodes")
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def root_to_leaf_paths(tree_or_parents) -> list[list[int]]:
    """One list of node indices per leaf, each starting at the root."""
    return [path_to(tree_or_parents, leaf) for leaf in leaves(tree_or_parents)]


def ancestor_mask(tree_or_parents) -> torch.Tensor:
    """Boolean ``(N, N)`` mask: ``mask[i, j]`` is True iff ``j`` is ``i`` or an ancestor of ``i``.

    Built row by row: a node's row is its parent's row plus itself.
    """
    parents = _parents_of(tree_or_parents).tolist()
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if parents[i] >= 0:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


def position_ids(tree_or_parents, prefix_len: int = 0) -> torch.Tensor:
    """Position id per node: ``prefix_len + depth`` (siblings share a position). ``(N,)``.

    ``prefix_len`` is the number of committed tokens *before* the root, so the root
    itself sits at position ``prefix_len``.
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    return depths(tree_or_parents) + prefix_len


def tree_attention_mask(tree_or_parents, prefix_len: int) -> torch.Tensor:
    """Boolean ``(N, prefix_len + N)`` mask of what each node may attend to.

    Every node sees the whole committed prefix (the KV cache) plus its own ancestors
    and itself among the tree nodes.
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    anc = ancestor_mask(tree_or_parents)
    n = anc.shape[0]
    prefix = torch.ones(n, prefix_len, dtype=torch.bool)
    return torch.cat([prefix, anc], dim=1)  # (N, P + N)


@dataclass(frozen=True)
class TreeBatch:
    """Several trees padded to a common node count.

    Attributes:
        tokens: ``(B, Nmax)`` token ids, padding = ``pad_token``.
        position_ids: ``(B, Nmax)`` positions (``prefix_lens[b] + depth``; padding repeats
            the last real position).
        mask: ``(B, Nmax, Pmax + Nmax)`` boolean attention mask. Row b attends to its own
            ``prefix_lens[b]`` prefix slots (right-aligned padding is the caller's choice:
            here prefix slots ``[0, prefix_lens[b])`` are real) and to its own ancestors.
            Padding query rows attend only to themselves so softmax stays finite.
        node_valid: ``(B, Nmax)`` True for real nodes.
        n_nodes: ``(B,)`` real node counts.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    node_valid: torch.Tensor
    n_nodes: torch.Tensor
    prefix_lens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))


def pad_masks(masks: Sequence[torch.Tensor], prefix_lens: Sequence[int]) -> torch.Tensor:
    """Batch per-row attention masks of new tokens over a right-padded KV cache.

    Row ``b`` feeds ``n_b`` new tokens after ``prefix_lens[b]`` cached slots; its own
    mask ``masks[b]`` is ``(n_b, prefix_lens[b] + n_b)`` (cache slots, then new tokens).

    Returns:
        ``(B, Nmax, Pmax + Nmax)`` bool: row b's cache slots at ``[0, prefix_lens[b])``,
        its new tokens at ``[Pmax, Pmax + n_b)``; padding query rows attend only to
        themselves, so their (ignored) outputs stay finite.
    """
    if len(masks) != len(prefix_lens):
        raise ValueError(f"got {len(masks)} masks but {len(prefix_lens)} prefix lengths")
    sizes = [int(m.shape[0]) for m in masks]
    nmax = max(sizes)
    pmax = max(int(p) for p in prefix_lens)
    out = torch.zeros(len(masks), nmax, pmax + nmax, dtype=torch.bool)
    for r, (own, n, p) in enumerate(zip(masks, sizes, prefix_lens)):
        p = int(p)
        if tuple(own.shape) != (n, p + n):
            raise ValueError(f"mask {r} must have shape ({n}, {p + n}) for {n} new tokens after {p} cached, "
                             f"got {tuple(own.shape)}")
        out[r, :n, :p] = own[:, :p]
        out[r, :n, pmax:pmax + n] = own[:, p:]
        idx = torch.arange(n, nmax)
        out[r, idx, pmax + idx] = True
    return out


def forward_mask(tree: DraftTree, side: "SideBranch | None" = None) -> torch.Tensor:
    """``(N+S, N+S)`` bool mask of one step's new tokens: the tree's ancestor mask, then
    the side branch (:class:`~specviz.tree.SideBranch`), which sees the root and its own
    mask and is seen by nothing else."""
    anc = ancestor_mask(tree)  # (N, N)
    if side is None:
        return anc
    n, s = tree.n_nodes, side.size
    out = torch.zeros(n + s, n + s, dtype=torch.bool)
    out[:n, :n] = anc
    out[n:, 0] = True
    out[n:, n:] = side.mask
    return out


def pad_trees(trees: Sequence[DraftTree], prefix_lens: Sequence[int], pad_token: int = 0,
              sides: "Sequence[SideBranch | None] | None" = None) -> TreeBatch:
    """Pad ``trees`` (one per batch row) to a common size and build their batched mask.

    Args:
        trees: one ``DraftTree`` per row.
        prefix_lens: committed prefix length per row (KV entries before the tree).
        pad_token: token id written into padding node slots.
        sides: per row, a :class:`~specviz.tree.SideBranch` fed after the tree's nodes at
            positions ``prefix_lens[b] + offset``, or None (default: none in any row).

    Returns:
        A ``TreeBatch``; the key axis of ``mask`` is ``max(prefix_lens) + Nmax`` wide, with
        row b's prefix occupying slots ``[0, prefix_lens[b])`` and its new tokens (tree
        nodes, then side tokens) occupying slots ``[Pmax, Pmax + Nmax)``. ``n_nodes``
        counts tree nodes only, so ``logits[b, :n_nodes[b]]`` are the tree's and the side
        tokens' follow them.
    """
    if len(trees) == 0:
        raise ValueError("pad_trees needs at least one tree")
    if len(prefix_lens) != len(trees):
        raise ValueError(f"got {len(trees)} trees but {len(prefix_lens)} prefix lengths")
    sides = [None] * len(trees) if sides is None else list(sides)
    if len(sides) != len(trees):
        raise ValueError(f"got {len(trees)} trees but {len(sides)} side branches")
    sizes = [t.n_nodes + (0 if side is None else side.size) for t, side in zip(trees, sides)]
    b, nmax = len(trees), max(sizes)
    tokens = torch.full((b, nmax), pad_token, dtype=torch.long)
    pos = torch.zeros(b, nmax, dtype=torch.long)
    valid = torch.zeros(b, nmax, dtype=torch.bool)
    masks = []
    for r, (tree, side, p) in enumerate(zip(trees, sides, prefix_lens)):
        p, n, size = int(p), tree.n_nodes, sizes[r]
        pr = position_ids(tree, p)
        tokens[r, :n] = tree.tokens
        if side is not None:
            tokens[r, n:size] = side.tokens
            pr = torch.cat([pr, p + side.offsets])
        pos[r, :size] = pr
        pos[r, size:] = pr.max()
        valid[r, :size] = True
        masks.append(torch.cat([torch.ones(size, p, dtype=torch.bool), forward_mask(tree, side)], dim=1))
    return TreeBatch(tokens, pos, pad_masks(masks, prefix_lens), valid,
                     torch.tensor([t.n_nodes for t in trees], dtype=torch.long),
                     torch.tensor([int(p) for p in prefix_lens], dtype=torch.long))
