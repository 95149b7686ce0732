"""SpecInfer's merged token tree: several drafters' proposals verified in one target call
(:class:`MergedDrafter`; the merge itself is :func:`specviz.tree.trie.merge_trees`)."""

from __future__ import annotations

from typing import Sequence

from specviz.draft.base import Drafter, run_draft_steps
from specviz.sampling import check_sibling_sampling, siblings_sampled
from specviz.tree.core import DraftTree
from specviz.tree.trie import merge_trees

__all__ = ["MergedDrafter"]


class MergedDrafter(Drafter):
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

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        drafters = list(drafters)
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        for i, d in enumerate(drafters):
            if not isinstance(d, Drafter):
                raise TypeError(f"drafters[{i}] must be a Drafter, got {type(d).__name__}")
            if d.needs_target_outputs:
                raise ValueError(f"drafters[{i}] ({d.name}) guesses from the target's outputs, which a merged tree "
                                 "does not pass on; run it on its own")
        self.drafters = drafters
        self.name = "merged(" + "+".join(d.name for d in drafters) + ")"
        # trained heads among the parts read the target's hidden states at the merged tree's nodes
        self.needs_target_hidden = any(d.needs_target_hidden for d in drafters)

    @property
    def heads_path(self):
        """The trained heads' result directory of the first part that drafts with heads
        (None if none does): what the benchmark records beside the name."""
        return next((d.heads_path for d in self.drafters if getattr(d, "heads_path", None) is not None), None)

    def observe_hidden(self, step, hidden) -> None:
        for d in self.drafters:
            if d.needs_target_hidden:
                d.observe_hidden(step, hidden)

    def draft(self, context, config, sibling_sampling, generator) -> DraftTree:
        return run_draft_steps(self.draft_steps(context, config, sibling_sampling, generator))

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

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()

    def spawn(self) -> "MergedDrafter":
        return MergedDrafter([d.spawn() for d in self.drafters])

    @property
    def tokenizers(self) -> tuple:
        return tuple(t for d in self.drafters for t in d.tokenizers)
