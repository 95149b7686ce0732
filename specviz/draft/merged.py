"""SpecInfer's merged token tree: several drafters' proposals verified in one target call
(:class:`MergedDrafter`; the merge itself is :func:`specviz.tree.trie.merge_trees`)."""

from __future__ import annotations

from typing import Sequence

from specviz.draft.base import CompositeDrafter, Drafter
from specviz.sampling import check_sibling_sampling, siblings_sampled
from specviz.tree.trie import merge_trees

__all__ = ["MergedDrafter"]


class MergedDrafter(CompositeDrafter):
    """SpecInfer's merged token tree: several drafters' proposals in one tree.

    Each drafter drafts from the same context; the trees are merged so that common
    prefixes are shared (:func:`specviz.tree.trie.merge_trees`) and one target call checks
    them all. ``tree.source`` tells which drafter proposed each node. Merged siblings
    come from different draft distributions, so the merged tree is deterministic
    (no ``draft_probs``): under sampling use a verifier whose ``sibling_sampling`` is
    "topk". The sub-drafters draft in "topk" mode and do not receive :meth:`observe`.

    Args:
        drafters: at least one drafter.
    """

    outputs_reason = ", which a merged tree does not pass on"

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        drafters = list(drafters)
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        super().__init__(drafters)
        self.name = "merged(" + "+".join(d.name for d in drafters) + ")"

    def draft_steps(self, context, config, sibling_sampling, generator):
        check_sibling_sampling(sibling_sampling)
        if siblings_sampled(config, sibling_sampling):
            raise ValueError(
                "a merged tree has deterministic siblings from several drafters; under sampling use a "
                f"verifier with sibling_sampling 'topk', not {sibling_sampling!r}")
        mode = "greedy" if config.greedy else "topk"
        trees = []
        for d in self.drafters:
            trees.append((yield from d.draft_steps(context, config, mode, generator)))
        return merge_trees(trees)
