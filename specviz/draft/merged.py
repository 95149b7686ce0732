"""SpecInfer's merged token tree: several drafters' proposals verified in one target call
(:class:`MergedDrafter`; the merge itself is :func:`specviz.tree.trie.merge_trees`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from specviz.draft.base import Drafter, drafting_steps, drafting_steps_within, spawn
from specviz.draft.composite import CompositeDrafter
from specviz.sampling import check_sibling_sampling, siblings_sampled
from specviz.tree.trie import merge_trees
from specviz.validate import check_int

__all__ = ["MergedDrafter", "merged_drafter"]


class MergedDrafter(CompositeDrafter):
    """SpecInfer's merged token tree: several drafters' proposals in one tree.

    Each drafter drafts from the same context; the trees are merged so that common
    prefixes are shared (:func:`specviz.tree.trie.merge_trees`) and one target call checks
    them all. ``tree.source`` tells which drafter proposed each node. Merged siblings
    come from different draft distributions, so the merged tree is deterministic
    (no ``draft_probs``): under sampling use a verifier whose ``sibling_sampling`` is
    "topk". The sub-drafters draft in "topk" mode and observe only the target's hidden states.

    With a ``budget`` the merged tree never holds more than ``budget`` draft nodes, and
    the parts share them in order: each part may add at most what the parts before it
    left: each part drafts through :func:`~specviz.draft.base.drafting_steps_within`
    with what is left. A part that grows its tree to a budget of its own (an EAGLE-2
    dynamic tree of the draft model or of a trained head, the n-gram trie) grows it to
    at most that many nodes in that step, so it keeps its best ones by its own ranking;
    any other part's tree is cut to its first nodes (parents come before children, so
    the cut is a tree). With prompt lookup first and a
    dynamic tree second, the lookup's chain takes the nodes it proposes (none where it
    finds no match) and the dynamic tree the rest. A part left no node in a step does
    not draft in it.

    Args:
        drafters: at least one drafter.
        budget: the most draft nodes of the merged tree (None: no limit, every part's
            whole tree).

    Raises:
        ValueError: no drafters, or a ``budget`` that is not a positive integer.
    """

    outputs_reason = ", which a merged tree does not pass on"

    def __init__(self, drafters: Sequence[Drafter], budget: int | None = None) -> None:
        drafters = list(drafters)
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        if budget is not None:
            check_int("budget", budget, note="(or None for no limit)")
        super().__init__(drafters)
        self.budget = budget
        parts = "+".join(d.name for d in drafters)
        self.name = f"merged({parts})" if budget is None else f"merged(n={budget}:{parts})"

    def spawn(self) -> "MergedDrafter":
        return MergedDrafter([spawn(d) for d in self.drafters], self.budget)

    def draft_steps(self, context, config, sibling_sampling, generator):
        check_sibling_sampling(sibling_sampling)
        if siblings_sampled(config, sibling_sampling):
            raise ValueError(
                "a merged tree has deterministic siblings from several drafters; under sampling use a "
                f"verifier with sibling_sampling 'topk', not {sibling_sampling!r}")
        mode = "greedy" if config.greedy else "topk"
        trees = []
        for d in self.drafters:
            if self.budget is None:
                trees.append((yield from drafting_steps(d, context, config, mode, generator)))
                continue
            left = self.budget - (merge_trees(trees).budget if trees else 0)
            if left <= 0:
                break
            trees.append((yield from drafting_steps_within(d, left, context, config, mode, generator)))
        return merge_trees(trees)


def merged_drafter(pair: Any, parts: Sequence[Callable[[Any], Drafter]], budget: int | None = None) -> MergedDrafter:
    """The :class:`MergedDrafter` (with ``budget``) of the drafters that the factories
    ``parts`` build for ``pair``, in their order. A module-level factory, so that
    ``functools.partial(merged_drafter, parts=[...], budget=16)`` can travel to a study
    worker as the other drafter factories do (e.g. prompt lookup built from its strategy
    name, then :func:`~specviz.heads.head_drafter` with a trained head's path).

    Raises:
        ValueError: no parts, or as :class:`MergedDrafter`.
    """
    if not parts:
        raise ValueError("merged_drafter needs at least one part")
    return MergedDrafter([make(pair) for make in parts], budget)
