"""The target's view of draft trees, for verification rules that sample.

Under sampling the committed text depends on the rule, so rules cannot be compared by
replaying one continuation; instead every rule is scored exactly on the same trees.
:class:`TreeScorer` returns the target's logits for draft trees at successive contexts
of one sequence (one forward per context, the KV cache reused, several trees merged
into one call), and :func:`score_rules` gives each rule's exact expected and one
realised acceptance on a tree; :func:`score_rules_along` scores every rule of
:data:`~specviz.verify.VERIFIERS` on the trees a draft model proposes at contexts along a
greedy continuation, at several temperatures.

Dimension legend: N = tree nodes including the root, P = context tokens before the
root, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specviz.decode.records import GenerationResult
from specviz.draft.model import ChainDrafter, TreeDrafter
from specviz.models.kvcache import crop_cache, forward_tokens, new_cache
from specviz.models.types import LoadedModel, ModelPair
from specviz.sampling import GREEDY, SamplingConfig
from specviz.tree.core import DraftTree, depths, tree_attention_mask
from specviz.tree.shapes import TreeShape
from specviz.tree.trie import merge_trees_with_map
from specviz.validate import check_int
from specviz.verify.rules import VERIFIERS, get_verifier

__all__ = ["TreeScorer", "RuleScore", "score_rules", "ContextRuleScore", "score_rules_along"]


class TreeScorer:
    """Target logits for draft trees at successive contexts of one sequence.

    The KV cache holds the context except its last token (the tree's root); moving to a
    longer context of the same sequence feeds only the new tokens. A tree is one forward
    with depth-based positions and the tree mask, after which the cache is cut back, so
    the result is what :func:`specviz.decode.speculative_generate` would give the
    verifier at that context.

    Args:
        target: the target model.
    """

    def __init__(self, target: LoadedModel) -> None:
        self.target = target
        self.cache = new_cache(target.model)
        self.prefix: list[int] = []

    def _sync(self, prefix: list[int]) -> None:
        common = 0
        limit = min(len(prefix), len(self.prefix))
        while common < limit and prefix[common] == self.prefix[common]:
            common += 1
        crop_cache(self.cache, common)
        if common < len(prefix):
            new = torch.tensor([prefix[common:]])  # (1, n)
            pos = torch.arange(common, len(prefix))[None]  # (1, n)
            forward_tokens(self.target.model, self.cache, new, pos, None, logits_to_keep=1)
        self.prefix = prefix

    def logits(self, context: Sequence[int], trees: Sequence[DraftTree]) -> list[torch.Tensor]:
        """``(N_i, V)`` target logits for each tree rooted at ``context[-1]``; row j is the
        target's distribution after node j. All trees go through one forward (merged into
        one token tree: a node attends only to its ancestors, so merging changes nothing).

        Raises:
            ValueError: if a tree's root is not ``context[-1]``.
        """
        context = [int(t) for t in context]
        if not context:
            raise ValueError("context must hold at least one token")
        for i, tree in enumerate(trees):
            if int(tree.tokens[0]) != context[-1]:
                raise ValueError(f"tree {i} is rooted at token {int(tree.tokens[0])}, not at the context's "
                                 f"last token {context[-1]}")
        merged = merge_trees_with_map(list(trees))
        tree = merged.tree
        self._sync(context[:-1])
        p = len(context) - 1
        allowed = tree_attention_mask(tree.parents, p)[None]  # (1, N, P + N)
        pos = (depths(tree) + p)[None]  # (1, N)
        logits = forward_tokens(self.target.model, self.cache, tree.tokens[None], pos, allowed)[0]  # (N, V)
        crop_cache(self.cache, p)
        return [logits[list(m)] for m in merged.node_maps]


@dataclass(frozen=True)
class RuleScore:
    """One verification rule on one draft tree.

    Attributes:
        rule: the verifier's name.
        drafted: draft nodes in the tree.
        expected: exact expected accepted draft tokens (:func:`specviz.verify.expected_accepted`).
        realised: draft tokens accepted by one verification with the given generator.
    """

    rule: str
    drafted: int
    expected: float
    realised: int


def score_rules(tree: DraftTree, target_logits: torch.Tensor, config: SamplingConfig,
                rules: Sequence[str], generator: torch.Generator) -> list[RuleScore]:
    """Exact expected and one realised acceptance of each rule in ``rules`` on ``tree``.

    Shapes: ``target_logits`` ``(N, V)``.
    """
    out = []
    for name in rules:
        verifier = get_verifier(name)
        expected = verifier.expected_accepted(tree, target_logits, config)
        realised = verifier(tree, target_logits, config, generator).n_accepted
        out.append(RuleScore(verifier.name, tree.budget, expected, realised))
    return out


@dataclass(frozen=True)
class ContextRuleScore:
    """One verification rule on the tree it needs, at one context and temperature.

    Attributes:
        position: continuation tokens before the context's end (0: the prompt alone).
        temperature: the sampling temperature.
        rule: the verifier's name.
        lossless: whether the rule keeps the target's distribution.
        drafted: draft nodes in the tree.
        expected: exact expected accepted draft tokens.
        realised: draft tokens accepted by one verification.
    """

    position: int
    temperature: float
    rule: str
    lossless: bool
    drafted: int
    expected: float
    realised: int


def score_rules_along(pair: ModelPair, reference: GenerationResult, *, shape: TreeShape, chain_length: int,
                      temperatures: Sequence[float], stride: int,
                      generator: torch.Generator) -> tuple[ContextRuleScore, ...]:
    """Every rule of :data:`~specviz.verify.VERIFIERS` on the trees the draft proposes at
    contexts every ``stride`` tokens along ``reference`` (a greedy continuation of the
    target), at each temperature.

    At each context the draft proposes a ``shape`` tree with top-k siblings (one tree for
    every temperature: top-k siblings do not depend on it), and per temperature trees
    with i.i.d. and without-replacement siblings (the top-k tree at temperature 0) and a
    chain of ``chain_length``; the target scores all of them in one forward
    (:class:`TreeScorer`) and each rule is scored on the tree its ``sibling_sampling``
    needs (the chain for ``chain``). The ``greedy`` rule is scored at temperature 0 only.

    Args:
        pair: the target and the draft.
        reference: the target's greedy continuation of one prompt; contexts end at
            positions ``0, stride, ...`` below ``reference.max_new_tokens - 1``.
        shape: the tree shape of the sibling-sampling trees.
        chain_length: draft tokens of the chain the ``chain`` rule verifies.
        temperatures: sampling temperatures, in the order scored.
        stride: continuation tokens between contexts.
        generator: every random draw (drafting and verification), in a fixed order.

    Returns:
        One score per (position, temperature, rule), in that nesting order.
    """
    check_int("chain_length", chain_length)
    check_int("stride", stride)
    scorer = TreeScorer(pair.target)
    tree_drafters = {mode: TreeDrafter(pair.draft, shape) for mode in ("topk", "iid", "without_replacement")}
    chain_drafter = ChainDrafter(pair.draft, chain_length)
    out = []
    for position in range(0, reference.max_new_tokens - 1, stride):
        context = torch.tensor(list(reference.prompt_ids) + list(reference.output_ids[:position]))  # (P + position,)
        # top-k siblings do not depend on the temperature: one tree serves every temperature
        topk_tree = tree_drafters["topk"].draft(context, GREEDY, "topk", generator)
        jobs = []  # (temperature, config, {sibling mode: tree}, chain tree)
        for t in temperatures:
            config = SamplingConfig(temperature=t)
            trees = {"greedy": topk_tree, "topk": topk_tree}
            for mode in ("iid", "without_replacement"):
                trees[mode] = topk_tree if config.greedy else tree_drafters[mode].draft(context, config, mode,
                                                                                          generator)
            jobs.append((t, config, trees, chain_drafter.draft(context, config, "iid", generator)))
        flat = [tree for _, _, trees, chain_tree in jobs for tree in (*trees.values(), chain_tree)]
        logits = iter(scorer.logits(context.tolist(), flat))
        for t, config, trees, chain_tree in jobs:
            logits_of = {id(tree): next(logits) for tree in (*trees.values(), chain_tree)}
            for rule in VERIFIERS:
                verifier = get_verifier(rule)
                if rule == "greedy" and not config.greedy:
                    continue  # the argmax rule is the temperature-0 rule
                tree = chain_tree if rule == "chain" else trees[verifier.sibling_sampling]
                (score,) = score_rules(tree, logits_of[id(tree)], config, [rule], generator)
                out.append(ContextRuleScore(position, t, rule, verifier.lossless, score.drafted, score.expected,
                                            score.realised))
    return tuple(out)
