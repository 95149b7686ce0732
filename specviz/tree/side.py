"""Side branches: tokens a step feeds to the target beside its draft tree.

Some strategies use the verification forward for more than verification. Lookahead
decoding (Fu et al., 2024) runs a window of Jacobi iterations in the same call: tokens
that are never committed, whose only purpose is the target's predictions at them.
A :class:`SideBranch` holds such tokens with their positions (offsets from the root)
and the mask among themselves. Side tokens see the committed prefix and the root; they
see no draft node and no draft node sees them, so the tree's logits are exactly what
they would be without the branch, and verification stays what it is.

:func:`forward_mask` lays out one step's full mask over ``[tree nodes, side tokens]``
(what the engine feeds and what :func:`specviz.render.lookahead_mask_figure` draws);
:func:`pad_forward` batches trees with optional side branches the way
:func:`~specviz.tree.pad_trees` batches bare trees.

Dimension legend: N = tree nodes including the root, S = side tokens, P = committed
prefix (cached), B = batch rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from specviz.tree.core import DraftTree, TreeBatch, ancestor_mask, pad_masks, position_ids

__all__ = ["SideBranch", "forward_mask", "pad_forward"]


@dataclass(frozen=True)
class SideBranch:
    """Tokens fed after the draft tree whose target predictions a drafter wants.

    Attributes:
        tokens: ``(S,)`` token ids.
        offsets: ``(S,)`` position of each token relative to the root (>= 1).
        mask: ``(S, S)`` bool, ``mask[i, j]``: side token ``i`` attends to side token
            ``j``; every side token also attends to the prefix and the root. Each token
            must attend to itself.
        groups: ``(S,)`` a label index per token for pictures (e.g. the window level).
        labels: the names of the group indices.
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    mask: torch.Tensor
    groups: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        tokens = torch.as_tensor(self.tokens, dtype=torch.long)
        offsets = torch.as_tensor(self.offsets, dtype=torch.long)
        mask = torch.as_tensor(self.mask, dtype=torch.bool)
        s = tokens.numel()
        if tokens.dim() != 1 or s == 0:
            raise ValueError(f"side tokens must be a non-empty 1-D sequence, got shape {tuple(tokens.shape)}")
        if tuple(offsets.shape) != (s,):
            raise ValueError(f"side offsets must have shape ({s},), got {tuple(offsets.shape)}")
        if int(offsets.min()) < 1:
            raise ValueError(f"side offsets must be >= 1 (the root is at offset 0), got {int(offsets.min())}")
        if tuple(mask.shape) != (s, s):
            raise ValueError(f"side mask must have shape ({s}, {s}), got {tuple(mask.shape)}")
        if not bool(mask.diagonal().all()):
            raise ValueError("every side token must attend to itself (the side mask's diagonal must be True)")
        groups = torch.as_tensor(self.groups, dtype=torch.long)
        if groups.numel() == 0:
            groups = torch.zeros(s, dtype=torch.long)
        if tuple(groups.shape) != (s,):
            raise ValueError(f"side groups must have shape ({s},), got {tuple(groups.shape)}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "mask", mask)
        object.__setattr__(self, "groups", groups)

    @property
    def size(self) -> int:
        """Number of side tokens."""
        return int(self.tokens.numel())

    @property
    def reach(self) -> int:
        """The largest offset from the root."""
        return int(self.offsets.max())


def forward_mask(tree: DraftTree, side: SideBranch | None = None) -> torch.Tensor:
    """``(N+S, N+S)`` bool mask of one step's new tokens: the tree's ancestor mask, then
    the side branch, which sees the root and its own mask and is seen by nothing else."""
    anc = ancestor_mask(tree)  # (N, N)
    if side is None:
        return anc
    n, s = tree.n_nodes, side.size
    out = torch.zeros(n + s, n + s, dtype=torch.bool)
    out[:n, :n] = anc
    out[n:, 0] = True
    out[n:, n:] = side.mask
    return out


def pad_forward(trees: Sequence[DraftTree], sides: Sequence[SideBranch | None], prefix_lens: Sequence[int],
                pad_token: int = 0) -> TreeBatch:
    """:func:`~specviz.tree.pad_trees` for trees followed by side branches.

    Row ``b`` feeds ``trees[b]``'s nodes, then ``sides[b]``'s tokens (if any) at
    positions ``prefix_lens[b] + offset``. ``n_nodes`` counts tree nodes only, so
    ``logits[b, :n_nodes[b]]`` are the tree's and the side tokens' follow them.
    """
    if len(trees) != len(sides) or len(trees) != len(prefix_lens):
        raise ValueError(f"got {len(trees)} trees, {len(sides)} side branches and {len(prefix_lens)} prefix lengths")
    if not trees:
        raise ValueError("pad_forward needs at least one tree")
    sizes = [t.n_nodes + (s.size if s is not None else 0) for t, s in zip(trees, sides)]
    b, nmax = len(trees), max(sizes)
    tokens = torch.full((b, nmax), pad_token, dtype=torch.long)
    pos = torch.zeros(b, nmax, dtype=torch.long)
    valid = torch.zeros(b, nmax, dtype=torch.bool)
    masks = []
    for r, (tree, side, p) in enumerate(zip(trees, sides, prefix_lens)):
        p, n = int(p), tree.n_nodes
        row_pos = position_ids(tree, p)
        tokens[r, :n] = tree.tokens
        if side is not None:
            tokens[r, n:sizes[r]] = side.tokens
            row_pos = torch.cat([row_pos, p + side.offsets])
        pos[r, :sizes[r]] = row_pos
        pos[r, sizes[r]:] = row_pos.max()
        valid[r, :sizes[r]] = True
        masks.append(torch.cat([torch.ones(sizes[r], p, dtype=torch.bool), forward_mask(tree, side)], dim=1))
    return TreeBatch(tokens, pos, pad_masks(masks, prefix_lens), valid,
                     torch.tensor([t.n_nodes for t in trees], dtype=torch.long),
                     torch.tensor([int(p) for p in prefix_lens], dtype=torch.long))
