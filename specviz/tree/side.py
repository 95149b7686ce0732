"""Side branches: tokens a step feeds to the target beside its draft tree.

Some strategies use the verification forward for more than verification. Lookahead
decoding (Fu et al., 2024) runs a window of Jacobi iterations in the same call: tokens
that are never committed, whose only purpose is the target's predictions at them.
A :class:`SideBranch` holds such tokens with their positions (offsets from the root)
and the mask among themselves. Side tokens see the committed prefix and the root; they
see no draft node and no draft node sees them, so the tree's logits are exactly what
they would be without the branch, and verification stays what it is.

:func:`~specviz.tree.forward_mask` lays out one step's full mask over ``[tree nodes,
side tokens]`` (what the engine feeds and what :func:`specviz.render.lookahead_mask_figure`
draws); :func:`~specviz.tree.pad_trees` batches trees with their side branches.

Dimension legend: N = tree nodes including the root, S = side tokens, P = committed
prefix (cached), B = batch rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


__all__ = ["SideBranch"]


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
