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

from specviz.sampling import GREEDY, SIBLING_SAMPLING, SamplingConfig, make_generator, probs_from_logits
from specviz.tree.core import DraftTree, children_lists
from specviz.verify.rules import (
    VERIFIERS,
    Acceptance,
    ChainVerifier,
    NaiveVerifier,
    SpecInferVerifier,
    TypicalVerifier,
    expected_accepted,
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


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Every tensor here is tiny: handing work to a second thread costs more than the
    # work itself, and the machine's cores are shared.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass(frozen=True)
class DraftBatch:
    """``n`` independent drafts of one tree shape."""

    parents: torch.Tensor  # (N,)
    tokens: torch.Tensor  # (n, N)
    target_logits: torch.Tensor  # (n, N, V)
    draft_probs: torch.Tensor  # (n, N, V)

    def tree(self, t: int) -> DraftTree:
        return DraftTree(self.tokens[t], self.parents, draft_probs=self.draft_probs[t])


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


@dataclass(frozen=True)
class Emitted:
    pairs: torch.Tensor  # (V, V) counts of the first two emitted tokens
    mean_accepted: float


def emitted_pairs(rule: str, shapes, n_per_shape: int, seed: int,
                  sibling_sampling: str | None = None) -> Emitted:
    """Run ``rule`` on fresh drafts and count the first two emitted tokens.

    Siblings are drafted as the rule asks unless ``sibling_sampling`` overrides it.
    When a step commits only one token, the second is drawn from the target after it,
    which is what the next (lossless) step would emit in distribution.
    """
    verifier = get_verifier(rule)
    how = sibling_sampling or verifier.sibling_sampling
    g = make_generator(seed)
    counts = torch.zeros(V * V, dtype=torch.long)
    accepted = 0
    for parents in shapes:
        batch = draft_batch(parents, n_per_shape, how, g)
        first = torch.empty(n_per_shape, dtype=torch.long)
        second = torch.full((n_per_shape,), -1, dtype=torch.long)
        for t in range(n_per_shape):
            acc = verifier(batch.tree(t), batch.target_logits[t], CONFIG, g)
            accepted += acc.n_accepted
            first[t] = acc.committed_tokens[0]
            if acc.tau > 1:
                second[t] = acc.committed_tokens[1]
        missing = second < 0
        p_next = TARGET.probs(first[missing, None])  # (m, V)
        second[missing] = torch.multinomial(p_next, 1, generator=g)[:, 0]
        counts += torch.bincount(first * V + second, minlength=V * V)
    return Emitted(counts.view(V, V), accepted / (n_per_shape * len(shapes)))


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
    """Twice the TV distance that sampling noise alone is expected to produce with ``n``
    draws over ``cells`` outcomes (E[TV] <= sqrt(cells / n) / 2 by Cauchy-Schwarz)."""
    return math.sqrt(cells / n)


# -- lossless rules reproduce the target ------------------------------------------------------

N_DISTRIBUTION = 6000  # trials per distribution test, split over the shapes


@pytest.mark.parametrize("rule", LOSSLESS_SAMPLERS)
def test_lossless_rule_reproduces_target_two_token_distribution(rule):
    shapes = CHAIN_SHAPES if rule == "chain" else TREE_SHAPES
    run = emitted_pairs(rule, shapes, N_DISTRIBUTION // len(shapes), seed=7)
    joint = target_pairs()
    p_first = chi_square_p(run.pairs.sum(1), joint.sum(1))
    p_pair = chi_square_p(run.pairs, joint)
    assert p_first > P_VALUE_FLOOR, f"{rule}: first token deviates (p = {p_first:.2e})"
    assert p_pair > P_VALUE_FLOOR, f"{rule}: first two tokens deviate (p = {p_pair:.2e})"
    # the drafts must often be accepted, or only the bonus-token path would be tested
    assert run.mean_accepted > 0.5


def test_distribution_test_catches_a_subtle_mismatch():
    # The same test, same size, fails when siblings are drawn without replacement but
    # verified with rule B (which assumes i.i.d. siblings): the test has teeth.
    run = emitted_pairs("specinfer", TREE_SHAPES, N_DISTRIBUTION // 2, seed=7,
                        sibling_sampling="without_replacement")
    assert chi_square_p(run.pairs, target_pairs()) < 1e-6


def test_specinfer_with_frequent_duplicate_siblings():
    # Four i.i.d. siblings at the root repeat a token in most drafts; the residual
    # arithmetic must still make the first token exact.
    n = 2000
    batch = draft_batch((-1, 0, 0, 0, 0), n, "iid", make_generator(5))
    repeats = sum(len(set(batch.tokens[t, 1:].tolist())) < 4 for t in range(n))
    assert repeats > n // 2
    verifier, g = get_verifier("specinfer"), make_generator(6)
    first = torch.zeros(V, dtype=torch.long)
    for t in range(n):
        first[verifier(batch.tree(t), batch.target_logits[t], CONFIG, g).committed_tokens[0]] += 1
    assert chi_square_p(first, target_pairs().sum(1)) > P_VALUE_FLOOR


def test_topk_is_exact_for_any_fixed_siblings_even_repeated():
    # Rule D treats the draft as deterministic, so it is exact for any fixed tree,
    # including one whose siblings repeat tokens (as a merged tree may).
    tree = DraftTree.from_lists([0, 2, 2, 4, 2, 1], [-1, 0, 0, 0, 1, 0])
    logits = TARGET.tables[0].expand(6, V)
    verifier, g = get_verifier("topk"), make_generator(4)
    first = torch.zeros(V, dtype=torch.long)
    for _ in range(2000):
        first[verifier(tree, logits, CONFIG, g).committed_tokens[0]] += 1
    assert chi_square_p(first, probs_from_logits(TARGET.tables[0][0], CONFIG)) > P_VALUE_FLOOR


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


# -- lossy rules do not -----------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["typical", "naive", "naive_half"])
def test_lossy_rule_visibly_deviates_from_target(rule):
    n = 1500
    run = emitted_pairs(rule, TREE_SHAPES[:1], n, seed=8)
    p1 = target_pairs().sum(1)
    first = run.pairs.sum(1)
    tv = total_variation(first, p1)
    assert not get_verifier(rule).lossless
    assert tv > tv_noise_bound(n, V), f"{rule}: TV {tv:.3f} is within sampling noise"
    assert chi_square_p(first, p1) < 1e-9


# -- exact expectations -----------------------------------------------------------------------

def _fixed_tree(tokens: list[int], parents: list[int]) -> tuple[DraftTree, torch.Tensor]:
    """A tree with DRAFT's distributions and TARGET's logits for its token paths."""
    logits, draft = [], []
    for u in range(len(tokens)):
        path, node = [], u
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        path_t = torch.tensor(path[::-1], dtype=torch.long).view(1, -1)
        logits.append(TARGET.logits(path_t)[0])
        draft.append(DRAFT.probs(path_t)[0])
    tree = DraftTree.from_lists(tokens, parents, draft_probs=torch.stack(draft))
    return tree, torch.stack(logits)


# root children repeat token 5; the second level repeats too
MC_TOKENS = [0, 5, 5, 1, 3, 1, 1, 0, 5, 3]
MC_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 1, 2, 5]


@pytest.mark.parametrize("rule", ["topk", "specinfer", "sequoia"])
def test_monte_carlo_agrees_with_exact_expectation(rule):
    tree, logits = _fixed_tree(MC_TOKENS, MC_PARENTS)
    verifier, g = get_verifier(rule), make_generator(21)
    n = 2500
    hits = torch.zeros(tree.n_nodes)
    lengths = torch.empty(n)
    for t in range(n):
        acc = verifier(tree, logits, CONFIG, g)
        hits[list(acc.accepted_nodes)] += 1
        lengths[t] = acc.n_accepted
    reach = node_reach_probs(tree, logits, CONFIG, rule)
    expected = expected_accepted(tree, logits, CONFIG, rule)
    assert expected == pytest.approx(float(reach[1:].sum()))
    assert expected > 0.5
    se = float(lengths.std()) / math.sqrt(n)
    assert abs(float(lengths.mean()) - expected) < 4 * se + 1e-9
    freq = hits / n
    node_se = (reach * (1 - reach) / n).sqrt().float()
    assert bool(((freq - reach.float()).abs()[1:] <= 4 * node_se[1:] + 1e-3).all()), (freq, reach)


def test_specinfer_expectation_averages_over_sibling_orders():
    # With a random order, two siblings carrying the same token are interchangeable;
    # in index order the second would be worth less.
    tree, logits = _fixed_tree(MC_TOKENS, MC_PARENTS)
    spec = node_reach_probs(tree, logits, CONFIG, "specinfer")
    assert float(spec[1]) == pytest.approx(float(spec[2]), abs=1e-12)
    topk = node_reach_probs(tree, logits, CONFIG, "topk")
    assert float(topk[2]) == 0.0 < float(topk[1])


def _order_probs_reference(p, q, toks, order) -> list[float]:
    """Brute force: P(sibling i accepted | parent reached) for rule B in a fixed order."""
    r, still, out = p.clone(), 1.0, [0.0] * len(toks)
    for i in order:
        x = toks[i]
        a = min(1.0, float(r[x] / q[x])) if q[x] > 0 else float(r[x] > 0)
        out[i] = still * a
        still *= 1.0 - a
        rest = (r - q).clamp(min=0.0)
        if rest.sum() > 0:
            r = rest / rest.sum()
    return out


@pytest.mark.parametrize("seed", range(6))
def test_specinfer_order_average_matches_brute_force(seed):
    g = make_generator(100 + seed)
    k = 3 + seed % 3
    logits = torch.randn(k + 1, V, generator=g) * 1.5
    q = probs_from_logits(torch.randn(V, generator=g) * 1.5, CONFIG)  # zeros from top_k
    toks = torch.multinomial(q, k, replacement=True, generator=g).tolist()
    toks[-1] = toks[0]  # always at least one repeated token
    draft = torch.zeros(k + 1, V)
    draft[0] = q
    tree = DraftTree.from_lists([0] + toks, [-1] + [0] * k, draft_probs=draft)
    p = probs_from_logits(logits[0], CONFIG).double()
    orders = list(itertools.permutations(range(k)))
    brute = torch.tensor([_order_probs_reference(p, q.double(), toks, o) for o in orders],
                         dtype=torch.float64)
    reach = node_reach_probs(tree, logits, CONFIG, "specinfer")
    assert torch.allclose(reach[1:], brute.mean(0), atol=1e-10), (reach[1:], brute.mean(0))


def test_topk_expectation_telescopes_only_for_distinct_siblings():
    def path_product(tree, logits):
        p = probs_from_logits(logits, CONFIG)  # (N, V)
        out = torch.ones(tree.n_nodes, dtype=torch.float64)
        for s in range(1, tree.n_nodes):
            u = int(tree.parents[s])
            out[s] = out[u] * float(p[u, tree.tokens[s]])
        return float(out[1:].sum())

    distinct, logits = _fixed_tree([0, 5, 1, 3, 1, 0, 3, 4], [-1, 0, 0, 0, 1, 1, 2, 5])
    assert expected_accepted(distinct, logits, CONFIG, "topk") == pytest.approx(
        path_product(distinct, logits), abs=1e-6)
    repeated, logits = _fixed_tree(MC_TOKENS, MC_PARENTS)
    # repeated siblings: the telescoped sum counts token 5 twice, the exact value once
    exact = expected_accepted(repeated, logits, CONFIG, "topk")
    assert exact < path_product(repeated, logits) - 0.05


@pytest.mark.parametrize("rule", ["topk", "specinfer", "sequoia", "chain"])
def test_reach_probs_are_a_consistent_distribution_over_paths(rule):
    shape = CHAIN_SHAPES[0] if rule == "chain" else TREE_SHAPES[0]
    how = get_verifier(rule).sibling_sampling
    batch = draft_batch(shape, 20, how, make_generator(31))
    for t in range(20):
        reach = node_reach_probs(batch.tree(t), batch.target_logits[t], CONFIG, rule)
        assert reach[0] == 1.0
        kids = children_lists(list(shape))
        for u, cs in enumerate(kids):
            if cs:
                # at most one child of a reached node is accepted
                assert float(reach[cs].sum()) <= float(reach[u]) + 1e-12


# -- greedy -----------------------------------------------------------------------------------

def _one_hot_logits(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 3.0
    return logits  # (N, vocab)


def test_greedy_follows_argmax_and_takes_the_first_duplicate():
    #          0
    #    1(3)  2(1)  3(1)      <- node 3 repeats node 2's token
    #          4(4)  5(2)
    #          6(0)
    tree = DraftTree.from_lists([0, 3, 1, 1, 4, 2, 0], [-1, 0, 0, 0, 2, 3, 4])
    logits = _one_hot_logits([1, 0, 4, 2, 2, 0, 0])  # argmax after each node
    for config in (GREEDY, SamplingConfig(temperature=0.7)):
        acc = get_verifier("greedy")(tree, logits, config, make_generator(0))
        assert acc.accepted_nodes == (2, 4)
        assert acc.accepted_tokens == (1, 4)
        assert acc.bonus_token == 2  # argmax after node 4; node 6 (token 0) is rejected
        assert acc.tried.tolist() == [True, True, True, False, True, False, True]
        assert acc.node_accept_prob.nan_to_num(-1).tolist() == [1.0, 0.0, 1.0, -1.0, 1.0, -1.0, 0.0]
        assert acc.rule == "greedy" and acc.lossless
    reach = node_reach_probs(tree, logits, GREEDY, "greedy")
    assert reach.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_greedy_reaching_a_leaf_gets_a_free_bonus_token():
    tree = DraftTree.from_lists([0, 1, 2], [-1, 0, 1])
    acc = get_verifier("greedy")(tree, _one_hot_logits([1, 2, 3]), GREEDY, make_generator(0))
    assert acc.committed_tokens == (1, 2, 3)
    assert (acc.n_accepted, acc.tau, acc.last_node) == (2, 3, 2)


@pytest.mark.parametrize("draft", ["random", "greedy", "none"])
def test_every_rule_reduces_to_greedy_at_temperature_zero(draft):
    # Siblings are distinct top-k tokens; the draft distribution is a full one, the
    # draft's own greedy one-hot (siblings other than the top-1 then have q = 0), or absent.
    g = make_generator(41)
    greedy = get_verifier("greedy")
    for shape in TREE_SHAPES + CHAIN_SHAPES:
        batch = draft_batch(shape, 15, "topk", g)
        for t in range(15):
            probs = None
            if draft == "random":
                probs = batch.draft_probs[t]
            elif draft == "greedy":
                probs = probs_from_logits(batch.draft_probs[t].log(), GREEDY)
            tree = DraftTree(batch.tokens[t], batch.parents, draft_probs=probs)
            logits = batch.target_logits[t]
            want = greedy(tree, logits, GREEDY, g)
            want_reach = node_reach_probs(tree, logits, GREEDY, "greedy")
            rules = ["specinfer", "sequoia", "topk", "typical"]
            if shape in CHAIN_SHAPES:
                rules.append("chain")
            for rule in rules:
                got = get_verifier(rule)(tree, logits, GREEDY, g)
                assert got.accepted_nodes == want.accepted_nodes, rule
                assert got.bonus_token == want.bonus_token, rule
                reach = node_reach_probs(tree, logits, GREEDY, rule)
                assert torch.equal(reach, want_reach), rule


# -- the API surface and its errors -----------------------------------------------------------

def test_registry_names_and_flags():
    assert set(VERIFIERS) == {"greedy", "chain", "specinfer", "sequoia", "topk", "typical",
                              "naive", "naive_half"}
    for name in VERIFIERS:
        verifier = get_verifier(name)
        assert verifier.name == name
        assert verifier.lossless == (name not in ("typical", "naive", "naive_half"))
        assert verifier.sibling_sampling in SIBLING_SAMPLING
    assert get_verifier("typical", eps=0.05) == TypicalVerifier(eps=0.05)
    assert get_verifier("naive_half") == NaiveVerifier(min_ratio=0.5)


def test_acceptance_properties():
    def make(nodes, tokens, bonus, n):
        return Acceptance(nodes, tokens, bonus, torch.ones(n), torch.ones(n, dtype=torch.bool),
                          "topk", True)

    acc = make((1, 3), (7, 9), 4, 4)
    assert (acc.n_accepted, acc.tau, acc.committed_tokens, acc.last_node) == (2, 3, (7, 9, 4), 3)
    empty = make((), (), 5, 1)
    assert (empty.n_accepted, empty.tau, empty.last_node) == (0, 1, 0)
    assert empty.committed_tokens == (5,)
    with pytest.raises(ValueError, match="differ in length"):
        make((1,), (), 5, 2)


def test_unknown_verifier_lists_valid_names():
    with pytest.raises(ValueError, match="bogus") as err:
        get_verifier("bogus")
    for name in VERIFIERS:
        assert name in str(err.value)
    tree, logits = _fixed_tree([0, 1], [-1, 0])
    with pytest.raises(ValueError, match="valid names"):
        expected_accepted(tree, logits, CONFIG, "bogus")


def test_bad_verifier_options():
    with pytest.raises(ValueError, match="eps"):
        get_verifier("typical", eps=0.0)
    with pytest.raises(TypeError, match="min_ratio"):
        get_verifier("naive", min_ratio=0.7)
    with pytest.raises(TypeError, match="topk"):
        get_verifier("topk", width=3)


def test_wrong_inputs_are_named():
    tree, logits = _fixed_tree([0, 1, 2], [-1, 0, 0])
    spec, g = get_verifier("specinfer"), make_generator(0)
    with pytest.raises(ValueError, match=r"\(3, V\).*\(2, 6\)"):
        spec(tree, logits[:2], CONFIG, g)
    with pytest.raises(ValueError, match="shape"):
        spec(tree, logits[0], CONFIG, g)
    with pytest.raises(TypeError, match="floating point"):
        spec(tree, logits.long(), CONFIG, g)
    with pytest.raises(ValueError, match="token id 2"):
        spec(tree, logits[:, :2], CONFIG, g)
    with pytest.raises(TypeError, match="generator"):
        spec(tree, logits, CONFIG, None)
    with pytest.raises(TypeError, match="SamplingConfig"):
        spec(tree, logits, 1.0, g)
    narrow = DraftTree(tree.tokens, tree.parents, draft_probs=tree.draft_probs[:, :4])
    with pytest.raises(ValueError, match="draft_probs has 4 columns"):
        spec(narrow, logits, CONFIG, g)
    empty = DraftTree(tree.tokens, tree.parents, draft_probs=torch.zeros(3, V))
    with pytest.raises(ValueError, match=r"draft_probs\[0\]"):
        spec(empty, logits, CONFIG, g)


def test_chain_verifier_refuses_a_branching_tree():
    tree, logits = _fixed_tree([0, 1, 2, 3], [-1, 0, 0, 1])
    with pytest.raises(ValueError, match="node 0 has 2 children"):
        get_verifier("chain")(tree, logits, CONFIG, make_generator(0))
    with pytest.raises(ValueError, match="chain"):
        expected_accepted(tree, logits, CONFIG, ChainVerifier())
    # the same tree is fine for the tree rules
    assert SpecInferVerifier()(tree, logits, CONFIG, make_generator(0)).rule == "specinfer"


@pytest.mark.parametrize("rule", ["chain", "specinfer", "sequoia", "naive", "naive_half", "typical"])
def test_leaf_rows_of_draft_probs_may_be_zero(rule):
    # Drafters leave the draft distribution of leaves empty; a path accepted up to a leaf
    # must only sample the bonus there, never read the leaf's (all-zero) draft row.
    v = 5
    q = torch.zeros(3, v)
    q[0, 1] = q[1, 2] = 1.0  # the draft is certain: root -> 1 -> 2; node 2 is a leaf
    tree = DraftTree.from_lists([0, 1, 2], [-1, 0, 1], q=[1.0, 1.0, 1.0], draft_probs=q)
    logits = torch.full((3, v), -30.0)
    logits[0, 1] = logits[1, 2] = logits[2, 3] = 30.0  # the target agrees and then says 3
    acc = get_verifier(rule)(tree, logits, SamplingConfig(temperature=1.0), make_generator(0))
    assert acc.accepted_nodes == (1, 2)
    assert acc.bonus_token == 3
