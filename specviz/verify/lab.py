"""Toy target and draft models over a handful of words, for studying verification rules.

A verification rule only ever sees a draft tree, the draft distributions its siblings
came from and the target's logits at every node. :class:`ToyModel` supplies those
without a language model: its next-token logits are a fixed random table indexed by
the tokens after the root, so two nodes with the same path get the same distribution,
as they would under a real model, and the exact target distribution of the first
emitted token is known. With thousands of verifications a second, this answers
"does rule X reproduce the target distribution?" by counting (:func:`check_rule`)
and "how long is the accepted path on average?" exactly
(:func:`expected_acceptance_table`).

* :func:`toy_pair` - a target and a draft correlated with it (the draft is a noisy,
  flattened copy), plus a :class:`ToyTokenizer` so trees are drawn with words;
* :func:`draft_tree` - fill a :class:`~specviz.tree.shapes.TreeShape` with draft tokens,
  drawing siblings the way a verifier requires (``sibling_sampling``);
* :func:`check_rule` - verify ``trials`` freshly drafted trees and compare the first
  emitted token's frequencies with the target distribution (chi-square test), next to
  the realised and exact expected accepted draft tokens per step; :func:`check_proposals` does the
  same for trees from any proposer (the deterministic guesses of Jacobi and lookahead);
* :func:`checks_table` / :func:`distributions_table` - the results as tidy tables.

Dimension legend: V = vocabulary size, N = tree nodes including the root,
d = number of tokens after the root.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import pandas as pd
import torch

from specviz.sampling import (
    SamplingConfig,
    check_sibling_sampling,
    make_generator,
    probs_from_logits,
    siblings_sampled,
)
from specviz.tree.shapes import TreeShape
from specviz.tree.core import DraftTree, path_to
from specviz.validate import check_int
from specviz.verify.rules import expected_accepted, get_verifier

__all__ = [
    "TOY_WORDS",
    "ToyTokenizer",
    "ToyModel",
    "ToyPair",
    "toy_pair",
    "draft_tree",
    "DistributionCheck",
    "check_rule",
    "check_proposals",
    "checks_table",
    "distributions_table",
    "expected_acceptance_table",
]

#: Words of the toy vocabulary, one per token id (the first ``vocab`` are used).
TOY_WORDS: tuple[str, ...] = (
    "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "was",
    "big", "red", "ball", "home",
)


@dataclass(frozen=True)
class ToyTokenizer:
    """Decodes toy token ids to words (enough for :mod:`specviz.render` labels)."""

    words: tuple[str, ...]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[int(i)] for i in ids)


@dataclass(frozen=True)
class ToyModel:
    """Next-token logits as a fixed table of the tokens after the root.

    Attributes:
        tables: ``tables[d]`` has shape ``(V**d, V)``: the logits after a path of ``d``
            tokens, row ``sum(path[i] * V**(d-1-i))``. Paths up to ``len(tables) - 1``
            tokens are covered.
    """

    tables: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if not self.tables:
            raise ValueError("a toy model needs at least the table for the empty path")
        v = self.tables[0].shape[-1]
        for d, table in enumerate(self.tables):
            if table.shape != (v ** d, v):
                raise ValueError(f"tables[{d}] must have shape ({v ** d}, {v}), got {tuple(table.shape)}")

    @property
    def vocab(self) -> int:
        return int(self.tables[0].shape[-1])

    @property
    def max_depth(self) -> int:
        """Longest path after the root the model has logits for."""
        return len(self.tables) - 1

    def logits(self, path: Sequence[int]) -> torch.Tensor:
        """``(V,)`` logits after the tokens ``path`` (root excluded)."""
        path = [int(t) for t in path]
        if len(path) > self.max_depth:
            raise ValueError(f"path of {len(path)} tokens is deeper than the model's {self.max_depth}")
        row = 0
        for t in path:
            if not 0 <= t < self.vocab:
                raise ValueError(f"token {t} is outside the vocabulary of {self.vocab}")
            row = row * self.vocab + t
        return self.tables[len(path)][row]

    def token_probs(self, tree: DraftTree, config: SamplingConfig) -> torch.Tensor:
        """``(N,)``: this model's probability of each node's token at its parent (root = 1),
        under ``config``; for the target, what the renderers show as ``p``."""
        probs = probs_from_logits(self.tree_logits(tree), config)  # (N, V)
        parents = tree.parents.clamp(min=0)  # (N,)
        out = probs[parents, tree.tokens]  # (N,)
        out[0] = 1.0
        return out

    def tree_logits(self, tree: DraftTree) -> torch.Tensor:
        """``(N, V)``: row i = logits for the token after node i (the verifier's ``target_logits``)."""
        tokens = tree.tokens.tolist()
        return torch.stack([self.logits([tokens[j] for j in path_to(tree, i)[1:]])
                            for i in range(tree.n_nodes)])


@dataclass(frozen=True)
class ToyPair:
    """A toy target, a toy draft and the words they speak."""

    target: ToyModel
    draft: ToyModel
    tokenizer: ToyTokenizer


def toy_pair(vocab: int = 8, max_depth: int = 3, *, sharpness: float = 1.5, draft_noise: float = 1.0,
             seed: int = 0) -> ToyPair:
    """A random target and a draft that agrees with it only partly.

    Target logits are ``sharpness * N(0, 1)``; the draft's are ``0.6 * target +
    draft_noise * N(0, 1)``, a flatter and noisier copy, so the draft's top-1 is the
    target's often but far from always.

    Args:
        vocab: number of tokens V (at most ``len(TOY_WORDS)``).
        max_depth: deepest tree the pair can score.
        sharpness: scale of the target logits (larger = more peaked target).
        draft_noise: scale of the draft's independent noise (0 = draft is 0.6 x target).
        seed: random seed.
    """
    check_int("vocab", vocab, 2, len(TOY_WORDS))
    check_int("max_depth", max_depth, 1, 6, note="(tables grow as vocab**depth)")
    if not sharpness > 0 or not draft_noise >= 0:
        raise ValueError(f"sharpness must be > 0 and draft_noise >= 0, got {sharpness} and {draft_noise}")
    g = make_generator(seed)
    target = tuple(sharpness * torch.randn(vocab ** d, vocab, generator=g) for d in range(max_depth + 1))
    draft = tuple(0.6 * t + draft_noise * torch.randn(t.shape, generator=g) for t in target)
    return ToyPair(ToyModel(target), ToyModel(draft), ToyTokenizer(TOY_WORDS[:vocab]))


def _draft_distribution(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    # Under greedy decoding the siblings are the draft's top ranks and q only describes
    # the draft; temperature 1 keeps it informative instead of one-hot.
    if config.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return probs_from_logits(logits, config)


def draft_tree(draft: ToyModel, shape: TreeShape, config: SamplingConfig, sibling_sampling: str,
               generator: torch.Generator, *, root_token: int = 0) -> DraftTree:
    """Fill ``shape`` with draft tokens, siblings drawn as ``sibling_sampling`` says.

    ``"greedy"`` and ``"topk"`` (and any mode under greedy decoding) take the draft's
    candidates of the shape's ranks; ``"iid"`` draws each child independently from
    ``q``; ``"without_replacement"`` draws distinct children (fewer when ``q`` has fewer
    tokens with positive probability, in which case the missing children's subtrees
    are left out).

    Returns:
        A tree with ``q``, ``ranks`` and ``draft_probs`` (``(N, V)``) filled in.
    """
    check_sibling_sampling(sibling_sampling)
    if shape.depth > draft.max_depth:
        raise ValueError(f"shape has depth {shape.depth} but the toy model covers only {draft.max_depth}")
    deterministic = not siblings_sampled(config, sibling_sampling)
    children: list[list[int]] = [[] for _ in range(shape.n_nodes)]
    for i in range(1, shape.n_nodes):
        children[shape.parents[i]].append(i)
    tokens, parents, q, ranks = [int(root_token)], [-1], [1.0], [0]
    dists: dict[int, torch.Tensor] = {}  # tree node -> (V,) draft distribution there
    paths: list[list[int]] = [[]]  # tokens after the root, per tree node
    made = {0: 0}  # shape node -> tree node
    for u in range(shape.n_nodes):  # parents precede children, so u is placed before its kids
        if u not in made:
            continue
        node = made[u]
        dist = _draft_distribution(draft.logits(paths[node]), config)  # (V,)
        dists[node] = dist
        kids = children[u]
        if not kids:
            continue
        order = torch.argsort(dist, descending=True, stable=True).tolist()
        if deterministic:
            picked = [order[shape.ranks[c]] for c in kids]
        else:
            count = len(kids)
            replacement = sibling_sampling == "iid"
            if not replacement:
                count = min(count, int((dist > 0).sum()))
            picked = torch.multinomial(dist, count, replacement=replacement, generator=generator).tolist()
        for c, tok in zip(kids, picked):
            made[c] = len(tokens)
            tokens.append(tok)
            parents.append(node)
            q.append(float(dist[tok]))
            ranks.append(order.index(tok))
            paths.append(paths[node] + [tok])
    draft_probs = torch.stack([dists[i] for i in range(len(tokens))])  # (N, V)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), q=torch.tensor(q),
                     ranks=torch.tensor(ranks), draft_probs=draft_probs)


@dataclass(frozen=True)
class DistributionCheck:
    """How the first emitted token of a rule is distributed, against the target.

    Attributes:
        rule: verifier name.
        sibling_sampling: how the trees' siblings were drafted.
        lossless: what the rule claims (and is, when siblings are drafted its way).
        trials: verifications run (one freshly drafted tree each).
        target: ``(V,)`` the target's exact distribution of the first token.
        empirical: ``(V,)`` observed frequencies of the first emitted token.
        chi2: Pearson statistic of the counts against ``target``.
        p_value: chance of a statistic at least this large if the rule were exact
            (0 when a token the target never emits came out).
        mean_accepted: realised accepted draft tokens per step.
        expected_accepted: exact expectation, averaged over the same trees.
    """

    rule: str
    sibling_sampling: str
    lossless: bool
    trials: int
    target: tuple[float, ...]
    empirical: tuple[float, ...]
    chi2: float
    p_value: float
    mean_accepted: float
    expected_accepted: float

    @property
    def tv_distance(self) -> float:
        """Total variation distance between the empirical and target distributions."""
        return 0.5 * sum(abs(a - b) for a, b in zip(self.empirical, self.target))

    def matches_target(self, alpha: float = 1e-3) -> bool:
        """True when the counts are consistent with the target at level ``alpha``."""
        return self.p_value >= alpha


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson chi-square of ``counts`` against ``probs`` (both ``(V,)``) and its p-value."""
    total = float(counts.sum())
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return math.inf, 0.0
    expected = probs[support] * total
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    if dof < 1:
        return stat, 1.0
    # Upper tail of the chi-square distribution = regularised upper incomplete gamma.
    p = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                      torch.tensor(stat / 2.0, dtype=torch.float64)))
    return stat, p


def check_rule(pair: ToyPair, shape: TreeShape, rule: str, config: SamplingConfig, *, trials: int,
               seed: int = 0, sibling_sampling: str | None = None) -> DistributionCheck:
    """Draft ``trials`` trees, verify each with ``rule`` and count the first emitted token.

    Args:
        pair: the toy target and draft.
        shape: tree shape to draft (a chain for the ``"chain"`` rule).
        rule: a verifier name (:data:`specviz.verify.VERIFIERS`).
        config: sampling configuration shared by draft and target.
        trials: number of verifications (>= 1).
        seed: seeds both drafting and verification.
        sibling_sampling: how siblings are drafted; default: the way ``rule`` requires.
            Pass another mode to see what drafting the wrong way does.
    """
    verifier = get_verifier(rule)
    mode = verifier.sibling_sampling if sibling_sampling is None else sibling_sampling
    return check_proposals(pair, lambda g: draft_tree(pair.draft, shape, config, mode, g), rule, config,
                           trials=trials, seed=seed, sibling_sampling=mode)


def check_proposals(pair: ToyPair, propose: Callable[[torch.Generator], DraftTree], rule: str,
                    config: SamplingConfig, *, trials: int, seed: int = 0,
                    sibling_sampling: str = "deterministic") -> DistributionCheck:
    """:func:`check_rule` for trees from any proposer, e.g. the guesses of a draft-free
    strategy (Jacobi, lookahead), which are fixed before the step and carry no draft
    distribution.

    Args:
        propose: ``propose(generator)`` -> a tree rooted at token 0 whose paths are at most
            ``pair.target.max_depth`` long; it may draw from ``generator``, which
            verification never touches.
        sibling_sampling: how the proposals came about, for the report.
        Other arguments as in :func:`check_rule`.
    """
    check_int("trials", trials)
    verifier = get_verifier(rule)
    g_draft = make_generator(seed)
    g_verify = make_generator(seed + 1)
    target_p = probs_from_logits(pair.target.logits([]), config).double()  # (V,)
    counts = torch.zeros(pair.target.vocab, dtype=torch.float64)  # (V,)
    accepted = 0
    expected = 0.0
    for _ in range(trials):
        tree = propose(g_draft)
        logits = pair.target.tree_logits(tree)  # (N, V)
        acc = verifier(tree, logits, config, g_verify)
        counts[acc.committed_tokens[0]] += 1
        accepted += acc.n_accepted
        expected += expected_accepted(tree, logits, config, rule=verifier)
    chi2, p_value = _chi_square(counts, target_p)
    return DistributionCheck(
        rule=verifier.name, sibling_sampling=sibling_sampling, lossless=verifier.lossless, trials=trials,
        target=tuple(target_p.tolist()), empirical=tuple((counts / trials).tolist()),
        chi2=chi2, p_value=p_value, mean_accepted=accepted / trials,
        expected_accepted=expected / trials,
    )


def checks_table(checks: Sequence[DistributionCheck], alpha: float = 1e-3) -> pd.DataFrame:
    """One row per check: rule, drafting, claim, distance to the target, test verdict and
    accepted draft tokens per step (``matches_target`` at level ``alpha``)."""
    return pd.DataFrame([{
        "rule": c.rule, "sibling_sampling": c.sibling_sampling, "lossless_claim": c.lossless,
        "trials": c.trials, "tv_distance": c.tv_distance, "chi2": c.chi2, "p_value": c.p_value,
        "matches_target": c.matches_target(alpha), "mean_accepted": c.mean_accepted,
        "expected_accepted": c.expected_accepted,
    } for c in checks])


def distributions_table(checks: Sequence[DistributionCheck], tokenizer: ToyTokenizer | None = None) -> pd.DataFrame:
    """Tidy per-token table: one row per (check, token) with target and empirical probability."""
    rows = []
    for c in checks:
        for t, (p, f) in enumerate(zip(c.target, c.empirical)):
            rows.append({"rule": c.rule, "sibling_sampling": c.sibling_sampling, "token": t,
                         "word": tokenizer.words[t] if tokenizer is not None else str(t),
                         "target": p, "empirical": f})
    return pd.DataFrame(rows)


def expected_acceptance_table(pair: ToyPair, shapes: Mapping[str, TreeShape], rules: Sequence[str],
                              temperatures: Sequence[float], *, trees: int, seed: int = 0) -> pd.DataFrame:
    """Exact expected accepted draft tokens per (shape, rule, temperature), averaged over
    ``trees`` trees drafted the way each rule requires (the same draws for every rule
    that drafts the same way). The ``"chain"`` rule is scored only on chain shapes.

    Returns:
        Columns ``shape, budget, rule, temperature, expected_accepted, expected_tau``.
    """
    check_int("trees", trees)
    rows = []
    for shape_name, shape in shapes.items():
        is_chain = shape.width <= 1
        for temperature in temperatures:
            config = SamplingConfig(temperature=float(temperature))
            for rule in rules:
                verifier = get_verifier(rule)
                if verifier.name == "chain" and not is_chain:
                    continue
                g = make_generator(seed)
                total = 0.0
                for _ in range(trees):
                    tree = draft_tree(pair.draft, shape, config, verifier.sibling_sampling, g)
                    total += expected_accepted(tree, pair.target.tree_logits(tree), config, rule=verifier)
                mean = total / trees
                rows.append({"shape": shape_name, "budget": shape.budget, "rule": verifier.name,
                             "temperature": float(temperature), "expected_accepted": mean,
                             "expected_tau": mean + 1.0})
    return pd.DataFrame(rows)
