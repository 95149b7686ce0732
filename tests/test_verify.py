"""Tests for specviz.verify: proofs, not promises.

* every lossless verifier reproduces the target's distribution over the first two
  emitted tokens (chi-square at a fixed seed, drafts re-drawn for every trial);
* every lossy rule visibly does not;
* exact expectations agree with Monte Carlo and with brute force over sibling orders;
* greedy on hand-built trees, and every lossless rule reduces to greedy at temperature 0;
* error cases name the bad value.

The target and the draft are "path models": tables of logits indexed by the tokens
after the root, so two nodes with the same path carry the same distribution, as they
would under a real language model.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from specviz.sampling import GREEDY, SamplingConfig, make_generator, probs_from_logits
from specviz.tree import DraftTree, children_lists
from specviz.verify import (
    SIBLING_SAMPLING,
    VERIFIERS,
    Acceptance,
    ChainVerifier,
    NaiveVerifier,
    SpecInferVerifier,
    TypicalVerifier,
    expected_accept_length,
    get_verifier,
    node_reach_probs,
)

V = 6  # vocabulary of the toy models
MAX_DEPTH = 3  # deepest node in the test shapes
# top_k=5 truncates both sides, so the target has tokens the draft cannot propose and
# the other way round: the edge cases of the residual arithmetic get exercised.
CONFIG = SamplingConfig(temperature=1.0, top_k=5)

TREE_SHAPES = (
    (-1, 0, 0, 0, 1, 1, 2, 4),  # three root children, uneven below, depth 3
    (-1, 0, 0, 1, 1, 2, 2),  # binary, depth 2
)
CHAIN_SHAPES = ((-1, 0, 1, 2),)

LOSSLESS_SAMPLERS = ("chain", "specinfer", "sequoia", "topk")
P_VALUE_FLOOR = 1e-3  # chi-square p-value below which a lossless rule fails


@dataclass(frozen=True)
class PathModel:
    """Logits as a function of the token path after the root."""

    tables: tuple[torch.Tensor, ...]  # tables[d]: (V**d, V) logits after a path of d tokens

    def logits(self, paths: torch.Tensor) -> torch.Tensor:
        """``(T, d)`` long paths -> ``(T, V)`` logits."""
        index = torch.zeros(paths.shape[0], dtype=torch.long)
        for i in range(paths.shape[1]):
            index = index * V + paths[:, i]
        return self.tables[paths.shape[1]][index]

    def probs(self, paths: torch.Tensor, config: SamplingConfig = CONFIG) -> torch.Tensor:
        return probs_from_logits(self.logits(paths), config)


def _models(seed: int) -> tuple[PathModel, PathModel]:
    g = make_generator(seed)
    target = [1.5 * torch.randn(V ** d, V, generator=g) for d in range(MAX_DEPTH + 1)]
    # the draft is correlated with the target but clearly different from it
    draft = [0.6 * t + 1.0 * torch.randn(t.shape, generator=g) for t in target]
    return PathModel(tuple(target)), PathModel(tuple(draft))


TARGET, DRAFT = _models(seed=1234)


@dataclass(frozen=True)
class DraftBatch:
    """``n`` independent drafts of one tree shape."""

    parents: torch.Tensor  # (N,)
    tokens: torch.Tensor  # (n, N)
    target_logits: torch.Tensor  # (n, N, V)
    draft_probs: torch.Tensor  # (n, N, V)

    def tree(self, t: int, with_draft: bool = True) -> DraftTree:
        return DraftTree(self.tokens[t], self.parents,
                         draft_probs=self.draft_probs[t] if with_draft else None)


def draft_batch(parents: tuple[int, ...], n: int, how: str, g: torch.Generator) -> DraftBatch:
    """Draft ``n`` trees of shape ``parents`` from DRAFT, siblings drawn as ``how`` says
    ("iid", "without_replacement" or "topk"), with TARGET's logits at every node."""
    size = len(parents)
    kids = children_lists(list(parents))
    tokens = torch.zeros(n, size, dtype=torch.long)
    target_logits = torch.empty(n, size, V)
    draft_probs = torch.empty(n, size, V)
    paths = {0: torch.zeros(n, 0, dtype=torch.long)}  # node -> (n, depth) tokens after the root
    for u in range(size):
        target_logits[:, u] = TARGET.logits(paths[u])
        q = DRAFT.probs(paths[u])  # (n, V)
        draft_probs[:, u] = q
        k = len(kids[u])
        if k == 0:
            continue
        if how == "topk":
            draws = q.topk(k, dim=-1).indices
        else:
            draws = torch.multinomial(q, k, replacement=(how == "iid"), generator=g)
        for i, s in enumerate(kids[u]):
            tokens[:, s] = draws[:, i]
            paths[s] = torch.cat([paths[u], draws[:, i:i + 1]], dim=1)
    return DraftBatch(torch.tensor(parents), tokens, target_logits, draft_probs)


def emitted_pairs(rule: str, shapes, n_per_shape: int, seed: int) -> torch.Tensor:
    """``(V, V)`` counts of the first two emitted tokens over fresh drafts.

    When a step commits only one token, the second is drawn from the target after it,
    which is what the next (lossless) step would emit in distribution.
    """
    verifier = get_verifier(rule)
    g = make_generator(seed)
    counts = torch.zeros(V * V, dtype=torch.long)
    for parents in shapes:
        batch = draft_batch(parents, n_per_shape, verifier.sibling_sampling, g)
        first = torch.empty(n_per_shape, dtype=torch.long)
        second = torch.full((n_per_shape,), -1, dtype=torch.long)
        for t in range(n_per_shape):
            committed = verifier(batch.tree(t), batch.target_logits[t], CONFIG, g).committed_tokens
            first[t] = committed[0]
            if len(committed) > 1:
                second[t] = committed[1]
        missing = second < 0
        p_next = TARGET.probs(first[missing, None])  # (m, V)
        second[missing] = torch.multinomial(p_next, 1, generator=g)[:, 0]
        counts += torch.bincount(first * V + second, minlength=V * V)
    return counts.view(V, V)


def target_pairs() -> torch.Tensor:
    """``(V, V)`` target probability of the first two tokens: p(x1) * p(x2 | x1)."""
    p1 = TARGET.probs(torch.zeros(1, 0, dtype=torch.long))[0]  # (V,)
    p2 = TARGET.probs(torch.arange(V)[:, None])  # (V, V)
    return p1[:, None] * p2


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's test; cells expecting fewer than 5 hits are pooled."""
    counts = counts.flatten().double()
    expected = probs.flatten().double() * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token the target can never emit was emitted"
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    freq = counts.flatten().double() / counts.sum()
    return 0.5 * float((freq - probs.flatten().double()).abs().sum())


def tv_noise_bound(n: int, cells: int) -> float:
    """Bound on the TV distance sampling noise alone produces: E[TV] <= sqrt(cells / n) / 2,
    so twice the expectation; a deviation above it is not noise."""
    return math.sqrt(cells / n)


# -- lossless rules reproduce the target ------------------------------------------------------

@pytest.mark.parametrize("rule", LOSSLESS_SAMPLERS)
def test_lossless_rule_reproduces_target_two_token_distribution(rule):
    shapes = CHAIN_SHAPES if rule == "chain" else TREE_SHAPES
    n_per_shape = 12_000 // len(shapes)
    counts = emitted_pairs(rule, shapes, n_per_shape, seed=7)
    joint = target_pairs()
    p_first = chi_square_p(counts.sum(1), joint.sum(1))
    p_pair = chi_square_p(counts, joint)
    assert p_first > P_VALUE_FLOOR, f"{rule}: first token deviates (p = {p_first:.2e})"
    assert p_pair > P_VALUE_FLOOR, f"{rule}: first two tokens deviate (p = {p_pair:.2e})"
    # the rule must also have accepted drafts, or the test would only check the bonus path
    assert total_variation(counts, joint) < tv_noise_bound(counts.sum().item(), V * V)


def test_sibling_sampling_names_are_known():
    for name in VERIFIERS:
        assert get_verifier(name).sibling_sampling in SIBLING_SAMPLING


def test_chain_and_specinfer_agree_step_for_step_on_a_chain():
    # On a chain there is no sibling order to draw, so the two rules consume the
    # generator identically and must return identical acceptances.
    batch = draft_batch(CHAIN_SHAPES[0], 200, "iid", make_generator(3))
    chain, spec = get_verifier("chain"), get_verifier("specinfer")
    g_chain, g_spec = make_generator(11), make_generator(11)
    for t in range(200):
        a = chain(batch.tree(t), batch.target_logits[t], CONFIG, g_chain)
        b = spec(batch.tree(t), batch.target_logits[t], CONFIG, g_spec)
        assert (a.accepted_nodes, a.bonus_token) == (b.accepted_nodes, b.bonus_token)
        assert torch.equal(a.node_accept_prob.nan_to_num(-1), b.node_accept_prob.nan_to_num(-1))


def test_specinfer_with_frequent_duplicate_siblings():
    # Four i.i.d. siblings at the root repeat a token in most drafts; the residual
    # arithmetic must still make the first token exact.
    parents = (-1, 0, 0, 0, 0)
    batch = draft_batch(parents, 4000, "iid", make_generator(5))
    repeats = sum(len(set(batch.tokens[t, 1:].tolist())) < 4 for t in range(4000))
    assert repeats > 2000
    verifier, g = get_verifier("specinfer"), make_generator(6)
    first = torch.zeros(V, dtype=torch.long)
    for t in range(4000):
        first[verifier(batch.tree(t), batch.target_logits[t], CONFIG, g).committed_tokens[0]] += 1
    assert chi_square_p(first, target_pairs().sum(1)) > P_VALUE_FLOOR


def test_topk_is_exact_for_any_fixed_siblings_even_repeated():
    # Rule D treats the draft as deterministic, so it is exact for any fixed tree,
    # including one whose siblings repeat tokens (as a merged tree may).
    tree = DraftTree.from_lists([0, 2, 2, 4, 2, 1], [-1, 0, 0, 0, 1, 0])
    logits = TARGET.tables[0].expand(6, V)
    verifier, g = get_verifier("topk"), make_generator(4)
    first = torch.zeros(V, dtype=torch.long)
    for _ in range(4000):
        first[verifier(tree, logits, CONFIG, g).committed_tokens[0]] += 1
    assert chi_square_p(first, probs_from_logits(TARGET.tables[0][0], CONFIG)) > P_VALUE_FLOOR


# -- lossy rules do not ------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["typical", "naive", "naive_half"])
def test_lossy_rule_visibly_deviates_from_target(rule):
    counts = emitted_pairs(rule, TREE_SHAPES[:1], 3000, seed=8)
    joint = target_pairs()
    first = counts.sum(1)
    tv = total_variation(first, joint.sum(1))
    assert not get_verifier(rule).lossless
    assert tv > 3 * tv_noise_bound(3000, V), f"{rule}: TV {tv:.3f} is within noise"
    assert chi_square_p(first, joint.sum(1)) < 1e-9


def test_specinfer_is_biased_when_siblings_are_not_iid():
    # The sibling_sampling contract matters: rule B fed top-k siblings (distinct tokens,
    # not i.i.d. draws) no longer reproduces the target.
    verifier = get_verifier("specinfer")
    g = make_generator(9)
    batch = draft_batch(TREE_SHAPES[0], 3000, "topk", g)
    first = torch.zeros(V, dtype=torch.long)
    for t in range(3000):
        first[verifier(batch.tree(t), batch.target_logits[t], CONFIG, g).committed_tokens[0]] += 1
    p1 = target_pairs().sum(1)
    assert total_variation(first, p1) > 3 * tv_noise_bound(3000, V)
